"""A real external client, `buf curl` (PyPI buf-bin), through server reflection: no proto files given."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import os

import pytest

pytestmark = pytest.mark.e2e

BUF = shutil.which("buf") or os.path.join(os.path.dirname(sys.executable), "buf")


def buf_curl(server, method: str, data: dict | None = None, *extra: str) -> subprocess.CompletedProcess:
    url = f"http://{server.target}" + (f"/{method}" if method else "")
    cmd = [BUF, "curl", "--protocol", "grpc", "--http2-prior-knowledge", *extra, url]
    if data is not None:
        cmd[2:2] = ["--data", json.dumps(data)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def need_buf():
    if not os.path.exists(BUF):
        pytest.fail("buf-bin is not installed (it is in the dev extra)")


def test_lists_services_through_reflection(server):
    out = buf_curl(server, "", None, "--list-services")
    assert out.returncode == 0, out.stderr
    services = out.stdout.split()
    assert "pagedserve.v1.InferenceService" in services and "grpc.health.v1.Health" in services
    methods = buf_curl(server, "", None, "--list-methods")
    assert "pagedserve.v1.InferenceService/Generate" in methods.stdout.split()


def test_health_check(server):
    out = buf_curl(server, "grpc.health.v1.Health/Check", {"service": "pagedserve.v1.InferenceService"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "SERVING"


def test_generate_streams(server, tokenizer):
    out = buf_curl(server, "pagedserve.v1.InferenceService/Generate",
                   {"prompt": "The capital of France is", "sampling": {"maxTokens": 8, "temperature": 0}})
    assert out.returncode == 0, out.stderr
    decoder, pos, messages = json.JSONDecoder(), 0, []
    text = out.stdout
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        msg, pos = decoder.raw_decode(text, pos)
        messages.append(msg)
    assert len(messages) >= 2  # streamed: one message per token
    ids = [int(t) for m in messages for t in m.get("tokenIds", [])]
    assert len(ids) == 8
    assert "".join(m.get("text", "") for m in messages) == tokenizer.decode(ids, skip_special_tokens=True)
    assert messages[-1]["finishReason"] == "FINISH_REASON_LENGTH"


def test_embed(server):
    out = buf_curl(server, "pagedserve.v1.InferenceService/Embed", {"inputs": ["hello world", "good night"]})
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert len(body["embeddings"]) == 2 and len(body["embeddings"][0]["values"]) == 384
    assert body["usage"]["promptTokens"] > 0


def test_invalid_argument_is_reported(server):
    out = buf_curl(server, "pagedserve.v1.InferenceService/Generate",
                   {"prompt": "hi", "sampling": {"temperature": -1}})
    assert out.returncode != 0
    assert "invalid_argument" in out.stderr.lower() and "sampling.temperature" in out.stderr
