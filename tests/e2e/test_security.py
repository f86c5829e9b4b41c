"""Callers that cannot be trusted: TLS and mutual TLS on both ports, API keys on both APIs (constant-time, a
rotating key file), bounded identifiers and values, and oversized prompts refused before they cost memory."""
from __future__ import annotations

import datetime
import hmac
import http.client
import ipaddress
import json
import ssl
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve_client import PagedServeClient, tls_credentials
from support import assert_no_blocks_held, free_port, server_sharing_model

pytestmark = pytest.mark.e2e

SERVICE = "pagedserve.v1.InferenceService"


# ---------------------------------------------------------------------------------------------- a test CA
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer_key, issuer_name, *, ca: bool = False, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name or _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(path, key, cert) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost / 127.0.0.1, a client certificate it signed, and a client
    certificate from another (unknown) CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _issue("pagedserve test CA", None, None, ca=True)
    other_key, other_cert = _issue("someone else's CA", None, None, ca=True)
    out = {"ca": _write(d / "ca", ca_key, ca_cert)[0]}
    out["server"] = _write(d / "server", *_issue("localhost", ca_key, ca_cert.subject, server=True))
    out["client"] = _write(d / "client", *_issue("a client", ca_key, ca_cert.subject))
    out["stranger"] = _write(d / "stranger", *_issue("a stranger", other_key, other_cert.subject))
    return out


def _ssl_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def _health(target: str, credentials) -> int:
    with grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status


def test_tls_on_both_ports_and_the_cli_health_check(server, pki):
    cert, key = pki["server"]
    with server_sharing_model(server, http_port=free_port(),
                              server_kwargs={"ssl_certfile": cert, "ssl_keyfile": key}) as tls:
        creds = tls_credentials(pki["ca"])
        assert _health(tls.target, creds) == health_pb2.HealthCheckResponse.SERVING
        with PagedServeClient(tls.target, credentials=creds, timeout_s=60) as client:
            assert client.generate_text("Hello", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError) as plain:
            _health(tls.target, None)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        https = tls.http_url.replace("http://", "https://")
        r = httpx.post(https + "/v1/completions", verify=_ssl_context(pki["ca"]), timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):
            httpx.get(tls.http_url + "/health", timeout=10)  # plaintext HTTP to a TLS port
        cli = [sys.executable, "-m", "pagedserve_client.cli", "--target", tls.target, "--tls-ca", pki["ca"],
               "--timeout", "10", "health", "--service", SERVICE]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "SERVING" in done.stdout


def test_mutual_tls_requires_a_certificate_from_the_ca(server, pki):
    cert, key = pki["server"]
    with server_sharing_model(server, http_port=free_port(), server_kwargs={
            "ssl_certfile": cert, "ssl_keyfile": key, "ssl_ca_certs": pki["ca"]}) as mtls:
        for who in (None, "stranger"):
            creds = tls_credentials(pki["ca"], *(pki[who] if who else (None, None)))
            with pytest.raises(grpc.RpcError) as refused:
                _health(mtls.target, creds)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, who
        signed = tls_credentials(pki["ca"], *pki["client"])
        assert _health(mtls.target, signed) == health_pb2.HealthCheckResponse.SERVING
        with PagedServeClient(mtls.target, credentials=signed, timeout_s=60) as client:
            assert client.generate_text("Hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        https = mtls.http_url.replace("http://", "https://")
        with pytest.raises(httpx.HTTPError):
            httpx.get(https + "/health", verify=_ssl_context(pki["ca"]), timeout=10)
        signed_ctx = _ssl_context(pki["ca"], *pki["client"])
        assert httpx.get(https + "/health", verify=signed_ctx, timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------- API keys
def test_api_key_on_grpc_and_http(server, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# rotated monthly\nkey-one\n")
    with server_sharing_model(server, embedding_model="llm", http_port=free_port(),
                              server_kwargs={"api_key_file": str(keys)}) as guarded:
        assert _health(guarded.target, None) == health_pb2.HealthCheckResponse.SERVING
        for key in (None, "wrong", "key-one-and-more"):
            with PagedServeClient(guarded.target, api_key=key or "", timeout_s=30) as client:
                for call in (lambda: client.generate_text("Hi", max_tokens=2), lambda: client.embed(["hi"])):
                    with pytest.raises(grpc.RpcError) as refused:
                        call()
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
        with PagedServeClient(guarded.target, api_key="key-one", timeout_s=60) as client:
            assert client.generate_text("Hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
            assert len(client.embed(["hi"]).embeddings) == 1
        url = guarded.http_url
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key-one"}).status_code == 200
        keys.write_text("key-one\nkey-two\n")  # rotation: the new key is accepted without a restart
        time.sleep(1.2)
        with PagedServeClient(guarded.target, api_key="key-two", timeout_s=60) as client:
            assert client.generate_text("Hi", max_tokens=1).usage.completion_tokens == 1
        keys.write_text("key-two\n")
        time.sleep(1.2)
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key-one"}).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key-two"}).status_code == 200
        assert_no_blocks_held(guarded)


def test_key_comparison_is_constant_time(monkeypatch, tmp_path):
    """Every configured key is compared through hmac.compare_digest on SHA-256 digests (equal lengths whatever was
    presented), and every key is compared on every check: no early exit on a match, so neither how much of a key
    matches nor which key matched changes the work done. (Structural, not timed: a timing ratio flaked on busy CI.)"""
    from pagedserve.serving import auth

    secret = "k" * 63 + "z"
    keys = auth.ApiKeys(secret)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    assert keys.check(secret) and not keys.check("k" * 64) and not keys.check("x") and not keys.check(None)
    assert calls == [(32, 32)] * 4  # digests: equal lengths whatever was presented
    calls.clear()
    (tmp_path / "keys").write_text("first\nsecond\nthird\n")
    rotated = auth.ApiKeys(api_key_file=str(tmp_path / "keys"))
    for presented in ("first", "third", "none-of-them", "firs"):
        rotated.check(presented)
    assert calls == [(32, 32)] * 12, calls  # three keys, each compared on each of the four checks
    assert rotated.check("first") and rotated.check("third") and not rotated.check("firs")


# ---------------------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("field,kwargs", [
    ("request_id", {"request_id": "r" * 1_000_000}),
    ("request_id", {"request_id": "line\nbreak"}),
    ("cache_salt", {"cache_salt": "s" * 257}),
    ("sampling.logit_bias", {"logit_bias": {5: 101.0}}),
    ("messages", {"messages": [("user", "x")] * 5000, "prompt": None}),
])
def test_bounded_fields_are_invalid_argument_naming_the_field(server, client, field, kwargs):
    args = {"prompt": "Hello", "max_tokens": 2, **kwargs}
    if args.get("prompt") is None:
        args.pop("prompt")
    with pytest.raises(grpc.RpcError) as refused:
        list(client.generate(**args))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field + ":"), refused.value.details()
    assert len(refused.value.details()) < 400  # the offending value is not echoed back
    assert_no_blocks_held(server)


def test_bounded_fields_over_http(server):
    url = server.http_url + "/v1/completions"
    for body, param in (({"request_id": "r" * 300}, "request_id"), ({"cache_salt": "s" * 257}, "cache_salt"),
                        ({"logit_bias": {"5": 101}}, "logit_bias")):
        r = httpx.post(url, json={"prompt": "Hello", "max_tokens": 2, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_log_lines_carry_bounded_client_strings():
    from pagedserve.logging import MAX_FIELD_CHARS, bound_strings

    event = bound_strings(None, "info", {"event": "request_rejected", "error": "x" * 1_000_000, "n": 3})
    assert len(event["error"]) < MAX_FIELD_CHARS + 40 and event["n"] == 3


# ---------------------------------------------------------------------------------------------- memory
def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_refused_huge_prompts_leave_memory_flat(server, client):
    """The server runs in this process: its RSS is this process's. 3 MB prompts (about 500,000 tokens, far past
    max_model_len) are refused from their length; after a warm-up, 100 of them over gRPC and 20 over HTTP."""
    huge = "hello world " * 250_000
    body = json.dumps({"prompt": huge, "max_tokens": 2}).encode()

    def refuse_grpc():
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate(huge, max_tokens=2))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in refused.value.details()

    def refuse_http():  # http.client: httpx's request objects sit in reference cycles (client-side garbage)
        conn = http.client.HTTPConnection("127.0.0.1", server.app.http_port, timeout=60)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        conn.close()
        assert response.status == 400 and error["param"] == "prompt"

    for _ in range(5):
        refuse_grpc()
        refuse_http()
    before = _rss_mib()
    started = time.monotonic()
    for _ in range(100):
        refuse_grpc()
    for _ in range(20):
        refuse_http()
    grown = _rss_mib() - before
    print(f"RSS after 100 + 20 refused 3 MB prompts: {grown:+.1f} MiB in {time.monotonic() - started:.1f} s")
    assert grown < 50, grown
    assert client.generate_text("Hello", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    assert_no_blocks_held(server)


def test_a_huge_embedding_input_is_refused_from_its_length(server, client):
    huge = "hello world " * 250_000
    with pytest.raises(grpc.RpcError) as refused:
        client.embed(["short", huge])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("inputs[1]:") and "cannot fit" in refused.value.details()
    assert len(client.embed([huge], truncate=True).embeddings) == 1  # truncate keeps its first tokens
