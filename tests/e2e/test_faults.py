"""Faults (issue 10): a failure while processing one request fails only that request; a fatal engine error turns
health NOT_SERVING and fails every open and new call with UNAVAILABLE, without hanging; a client killed in the
middle of a stream is detected, its request aborted and its KV blocks freed."""
from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.core import detokenizer
from pagedserve.request import RequestStatus
from pagedserve_client import pb
from pagedserve_client.v1 import inference_pb2_grpc

from support import assert_no_blocks_held, server_sharing_model, wait_until

pytestmark = pytest.mark.e2e

SERVICE = "pagedserve.v1.InferenceService"
FAULTY_PROMPT = [2000 + i for i in range(10)]
GOOD_PROMPTS = [[1000 + i for i in range(7)], [3000 + 3 * i for i in range(12)], [5000, 5001, 5002]]


def greedy(prompt: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling))


async def _stream(stub, req: pb.GenerateRequest, timeout_s: float = 120) -> tuple[str, str, list[int], str]:
    """(status name, details, token ids, text) of one Generate call read to its end."""
    call = stub.Generate(req, timeout=timeout_s)
    ids, text = [], ""
    try:
        async for msg in call:
            ids += msg.token_ids
            text += msg.text
    except grpc.aio.AioRpcError:
        pass
    return (await call.code()).name, await call.details() or "", ids, text


def run_streams(target: str, requests: list[pb.GenerateRequest]) -> list[tuple[str, str, list[int], str]]:
    async def main():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            return await asyncio.gather(*(_stream(stub, r) for r in requests))
    return asyncio.run(main())


def _fault_in_detokenizer(monkeypatch, should_fail) -> None:
    original = detokenizer.IncrementalDetokenizer.add_tokens

    def add_tokens(self, token_ids):
        if should_fail(self):
            raise RuntimeError("injected detokenizer fault")
        return original(self, token_ids)
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add_tokens", add_tokens)


def _fault_in_stop_matching(monkeypatch, should_fail) -> None:
    """Stop-string matching fails at the third token of the request whose stop strings include "ZZZ-fault"."""
    original = detokenizer._StopMatcher.push

    def push(self, text):
        if "ZZZ-fault" in self._stops:
            self.num_pushes = getattr(self, "num_pushes", 0) + 1
            if self.num_pushes >= 3:
                raise RuntimeError("injected stop-string fault")
        return original(self, text)
    monkeypatch.setattr(detokenizer._StopMatcher, "push", push)


@pytest.mark.parametrize("inject", [_fault_in_detokenizer, _fault_in_stop_matching], ids=["detokenize", "stop"])
def test_a_failure_in_one_request_fails_only_that_request(server, monkeypatch, inject):
    good = [greedy(p, 12) for p in GOOD_PROMPTS]
    expected = run_streams(server.target, good)
    assert all(code == "OK" and len(ids) == 12 for code, _, ids, _ in expected), expected
    # The faulty request fails at its third token, in the middle of its stream and of the others'.
    inject(monkeypatch, lambda d: tuple(d.prompt_token_ids) == tuple(FAULTY_PROMPT) and len(d.token_ids) >= 2)
    faulty = greedy(FAULTY_PROMPT, 12, stop=["ZZZ-fault"] if inject is _fault_in_stop_matching else [])
    results = run_streams(server.target, [good[0], faulty, good[1], good[2]])
    code, details, ids, _ = results[1]
    assert code == "INTERNAL" and "injected" in details and "fault" in details, (code, details)
    assert len(ids) < 12
    assert [r[0] for r in results[:1] + results[2:]] == ["OK"] * 3
    assert [r[2:] for r in results[:1] + results[2:]] == [e[2:] for e in expected]   # same tokens, same text
    assert_no_blocks_held(server)


def test_a_failure_in_one_of_n_completions_aborts_its_siblings(server, monkeypatch):
    """n = 2: when one completion fails, the request fails and its other completion stops too (nobody reads it)."""
    failed = []

    def fail_once(d):
        if tuple(d.prompt_token_ids) == tuple(FAULTY_PROMPT) and len(d.token_ids) >= 2 and not failed:
            failed.append(d)
            return True
        return False
    _fault_in_detokenizer(monkeypatch, fail_once)
    rid = f"fault-n2-{uuid.uuid4().hex[:8]}"
    req = greedy(FAULTY_PROMPT, 400, n=2)
    req.request_id = rid
    try:
        ((code, details, _, _),) = run_streams(server.target, [req])
        assert code == "INTERNAL" and "injected" in details
        # Without the abort, the other completion would run on for ~400 steps.
        wait_until(lambda: rid not in server.engine.groups, 5, "the sibling completion to be aborted")
    finally:  # leave nothing running for the next tests
        server.run(server.app.services.generation.abort([rid]))
    assert_no_blocks_held(server)


def test_a_killed_client_is_detected_and_its_request_aborted(server):
    rid = f"killed-{uuid.uuid4().hex[:8]}"
    script = (
        "import sys, grpc\n"
        "from pagedserve_client import pb\n"
        "from pagedserve_client.v1 import inference_pb2_grpc as g\n"
        "stub = g.InferenceServiceStub(grpc.insecure_channel(sys.argv[1]))\n"
        "req = pb.GenerateRequest(request_id=sys.argv[2], prompt_token_ids=pb.TokenIds(ids=list(range(500, 540))),\n"
        "                         sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0))\n"
        "for msg in stub.Generate(req):\n"
        "    print(len(msg.token_ids), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, server.target, rid], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline(), "the client never received a message"
        group = server.engine.groups.get(rid)
        assert group is not None, "the request is not live on the server"
        (request,) = group.children
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        start = time.monotonic()
        wait_until(lambda: rid not in server.engine.groups, 10, "the server to notice the dead client")
        detected_s = time.monotonic() - start
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.stdout.close()
    assert request.status == RequestStatus.FINISHED_ABORTED and request.num_output_tokens < 2000
    assert not request.blocks
    assert_no_blocks_held(server)
    print(f"\nkilled client detected and aborted after {detected_s:.2f} s")


def test_a_fatal_engine_error_fails_every_call_with_unavailable(server):
    with server_sharing_model(server, num_kv_blocks=64, max_num_seqs=8) as small:
        asyncio.run(_fatal_error_scenario(small))


async def _fatal_error_scenario(small) -> None:
    async with grpc.aio.insecure_channel(small.target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        calls = [stub.Generate(greedy(p, 500), timeout=60) for p in GOOD_PROMPTS]
        for call in calls:                      # every stream is open and producing
            await call.read()

        def boom(sched):
            raise RuntimeError("injected fatal fault")
        small.engine.executor.worker.runner.execute = boom
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "injected fatal fault" in err.value.details()
        for service in (SERVICE, ""):
            deadline = time.monotonic() + 5
            while (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, f"health of {service!r} is still not NOT_SERVING"
                await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(greedy(GOOD_PROMPTS[0], 4), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert list((await stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=10)).aborted_request_ids) == []
