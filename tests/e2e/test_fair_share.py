"""Fair shares through both APIs: the caller is named by a header the operator picks (``--fair-share-by
header:x-caller``, gRPC metadata or HTTP header) or by the API key presented (``api-key``: a key-file line's name,
else a pseudonym), and each caller's tokens show in /metrics; bad settings are refused naming the field."""
from __future__ import annotations

import hashlib
import re

import grpc
import httpx
import pytest

from pagedserve.config import EngineConfig, ServerConfig
from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc
from support import free_port, server_sharing_model

pytestmark = pytest.mark.e2e


def _caller_series(s, family: str = "caller_tokens_total", key=("caller", "kind")) -> dict[tuple, float]:
    out = {}
    for line in httpx.get(s.http_url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'^pagedserve:' + family + r'\{(.*)\} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[tuple(labels[k] for k in key)] = float(m.group(2))
    return out


def _caller_tokens(s) -> dict[tuple[str, str], float]:
    return _caller_series(s)


def _generate(target: str, metadata=()) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        list(stub.Generate(pb.GenerateRequest(prompt="Hello there", sampling=pb.SamplingParams(
            max_tokens=4, ignore_eos=True)), metadata=metadata, timeout=120))


def test_callers_named_by_a_header_on_both_apis(server):
    with server_sharing_model(server, http_port=free_port(), server_kwargs={"fair_share_by": "header:x-caller"},
                              fair_share_weights='{"gold": 2}') as s:
        r = httpx.post(s.http_url + "/v1/completions", headers={"x-caller": "gold"}, timeout=120,
                       json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        _generate(s.target, metadata=(("x-caller", "silver"),))
        _generate(s.target)                                   # no header: the unnamed caller
        tokens = _caller_tokens(s)
        assert tokens[("gold", "decode")] >= 2 and tokens[("gold", "prefill")] >= 1, tokens
        assert tokens[("silver", "decode")] >= 3 and tokens[("_unnamed", "decode")] >= 3, tokens
        waits = _caller_series(s, "caller_queue_time_seconds_count", ("caller",))
        assert waits[("gold",)] == 1 and waits[("silver",)] == 1 and waits[("_unnamed",)] >= 1, waits  # + warm-up
        assert all(v >= 0 for v in _caller_series(s, "caller_queue_time_seconds_sum", ("caller",)).values())
        assert set(_caller_series(s, "caller_deadline_refusals_total", ("caller",)).values()) == {0}


def test_callers_named_by_their_api_key(server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-team-a team-a\nsk-anonymous\n")
    with server_sharing_model(server, http_port=free_port(), server_kwargs={
            "fair_share_by": "api-key", "api_key_file": str(keys)}) as s:
        r = httpx.post(s.http_url + "/v1/completions", headers={"authorization": "Bearer sk-team-a"}, timeout=120,
                       json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        _generate(s.target, metadata=(("authorization", "Bearer sk-anonymous"),))
        pseudonym = "key-" + hashlib.sha256(b"sk-anonymous").hexdigest()[:8]
        tokens = _caller_tokens(s)
        assert tokens[("team-a", "decode")] >= 2 and tokens[(pseudonym, "decode")] >= 3, tokens
        assert not any("sk-" in caller for caller, _ in tokens)   # never the key itself


@pytest.mark.parametrize("kwargs, field", [
    ({"fair_share_by": "user"}, "fair_share_by"), ({"fair_share_by": "header:"}, "fair_share_by")])
def test_bad_fair_share_by_is_refused_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**kwargs)


@pytest.mark.parametrize("weights", ['{"a": 0}', '{"a": "x"}', '[1]', 'not json'])
def test_bad_weights_are_refused_naming_the_field(weights):
    with pytest.raises(ValueError, match="fair_share_weights"):
        EngineConfig(fair_share_weights=weights)


def test_get_model_info_says_how_calls_are_scheduled(server):
    with server_sharing_model(server, server_kwargs={"fair_share_by": "header:x-caller"},
                              fair_share_weights='{"gold": 2}', max_queue_time_s=30.0) as s, \
            grpc.insecure_channel(s.target) as channel:
        info = pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30).scheduling
        assert info.deadline_scheduling and info.max_queue_time_s == 30.0
        assert info.fair_share_by == "header:x-caller" and dict(info.fair_share_weights) == {"gold": 2.0}
