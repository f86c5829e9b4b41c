"""Deadlines the scheduler keeps, through both APIs (one server on the session's model, one running request at a
time, --max-queue-time-s 3): a call that cannot finish by its gRPC deadline or HTTP ``timeout`` is refused before
any prefill with DEADLINE_EXCEEDED + google.rpc.RetryInfo / HTTP 504 + Retry-After, long before the deadline
itself; one whose deadline passes while it waits is refused by the server before the client gives up; one with
room finishes; a call with no deadline is refused after --max-queue-time-s; the counters say so and no KV block is
held afterwards."""
from __future__ import annotations

import re
import threading
import time

import grpc
import httpx
import pytest
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc
from support import assert_no_blocks_held, free_port, server_sharing_model, wait_until

pytestmark = pytest.mark.e2e

PROMPT = list(range(1000, 1016))


@pytest.fixture(scope="module")
def busy(server):
    """The server, and a blocker: one long request occupying the only running seat (cancelled at the end)."""
    with server_sharing_model(server, http_port=free_port(), max_num_seqs=1, max_queue_time_s=3.0) as s:
        channel = grpc.insecure_channel(s.target)
        stub = pb_grpc.InferenceServiceStub(channel)
        blocker = stub.Generate(_request(4000), timeout=600)
        next(blocker)                                   # running: its first token is out, steps are measured
        yield s, stub, blocker
        blocker.cancel()
        channel.close()
        assert_no_blocks_held(s)


def _request(max_tokens: int, prompt=PROMPT) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _metric(s, name: str, **labels) -> float:
    text = httpx.get(s.http_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^pagedserve:{name}(?:_total)?(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _retry_delay_s(error: grpc.RpcError) -> float:
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status in the trailers"
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def test_infeasible_grpc_call_refused_at_once_with_retry_info(busy):
    s, stub, _ = busy
    before = _metric(s, "deadline_refusals", reason="infeasible")
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(3000), timeout=20))   # 3,000 steps cannot fit in 20 s here
    took = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot finish within the deadline" in e.value.details(), e.value.details()
    assert took < 5, took                                 # refused on arrival, not when the deadline ran out
    assert _retry_delay_s(e.value) >= 1.0
    assert _metric(s, "deadline_refusals", reason="infeasible") == before + 1
    assert _metric(s, "deadline_refused_prefill_tokens") == 0


def test_a_waiting_call_is_refused_before_its_deadline_passes(busy):
    s, stub, _ = busy
    before = _metric(s, "deadline_refusals")
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(12), timeout=2.5))    # feasible on arrival; the seat never frees in time
    took = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot finish within the deadline" in e.value.details(), e.value.details()  # the server said it
    assert took < 2.5, took
    assert rpc_status.from_call(e.value) is not None
    assert _metric(s, "deadline_refusals") == before + 1
    assert _metric(s, "deadline_refused_prefill_tokens") == 0


def test_http_timeout_refused_with_504_and_retry_after(busy):
    s, _, _ = busy
    r = httpx.post(s.http_url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "timeout": 20})
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "deadline_exceeded" and err["type"] == "timeout_error", err
    assert "cannot finish within the deadline" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(s.http_url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "timeout": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text


def test_no_deadline_waits_max_queue_time_then_refused(busy):
    s, stub, _ = busy
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(4)))                  # no deadline: --max-queue-time-s 3 applies
    took = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "--max-queue-time-s 3" in e.value.details(), e.value.details()
    assert 3 <= took < 10, took
    assert _metric(s, "deadline_refusals", reason="queue_time") >= 1


def test_a_call_with_room_finishes(server):
    with server_sharing_model(server, max_num_seqs=4) as s, grpc.insecure_channel(s.target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        out = list(stub.Generate(_request(8), timeout=120))
        assert sum(len(m.token_ids) for m in out) == 8 and out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert s.engine.stats()["deadline_misses"] == 0
