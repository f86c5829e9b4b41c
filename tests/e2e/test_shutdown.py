"""Graceful shutdown of a real `pagedserve serve` process: on SIGTERM health turns NOT_SERVING, new calls get
UNAVAILABLE, a stream that can finish within --shutdown-grace finishes normally, one that cannot ends with ABORT
when the grace runs out, and the process exits 0."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc
from support import ServerProcess, free_port

pytestmark = pytest.mark.e2e

GRACE_S = 6.0
SERVICE = "pagedserve.v1.InferenceService"


def _consume_sse(url: str, body: dict, out: dict, first: threading.Event) -> None:
    """Read an HTTP completion stream: its data events, in order."""
    out["events"] = []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                first.set()
    first.set()


def _consume(call, out: dict, first: threading.Event) -> None:
    out["responses"] = []
    try:
        for response in call:
            out["responses"].append(response)
            first.set()
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as err:
        out["code"] = err.code()
    first.set()


@pytest.mark.slow
def test_sigterm_drains_streams_refuses_new_calls_and_exits_zero():
    """gRPC and HTTP alike: open streams that can finish within the grace finish, the others end with "abort";
    new calls are refused (UNAVAILABLE, HTTP 503) from the signal on."""
    http_port = free_port()
    http = f"http://127.0.0.1:{http_port}"
    server = ServerProcess("--shutdown-grace-s", str(GRACE_S), "--num-kv-blocks", "300", http_port=http_port)
    try:
        port = server.wait_event("server_listening", 60)["port"]
        ready = server.wait_event("ready", 600)
        from pagedserve.kernels.cpu_build import cpu_kernel_ops
        assert ready["linear_kernels"] == ("pagedserve-cpu" if cpu_kernel_ops() is not None else "torch")
        assert ready["speculative"] is None and ready["quantization"].startswith("gguf")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")  # no retry policy: every refusal is seen as is
        stub, health = pb_grpc.InferenceServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        sampling = dict(temperature=0.0, ignore_eos=True)
        short = stub.Generate(pb.GenerateRequest(prompt="Once upon a time",
                                                 sampling=pb.SamplingParams(max_tokens=4, **sampling)))
        endless = stub.Generate(pb.GenerateRequest(prompt="List every prime number:",
                                                   sampling=pb.SamplingParams(max_tokens=4000, **sampling)))
        results, threads = [], []
        for call in (short, endless):
            out, first = {}, threading.Event()
            threads.append(threading.Thread(target=_consume, args=(call, out, first), daemon=True))
            threads[-1].start()
            results.append((out, first))
        http_results = []
        for max_tokens in (4, 4000):
            out, first = {}, threading.Event()
            body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                    "temperature": 0}
            threads.append(threading.Thread(target=_consume_sse, args=(http + "/v1/completions", body, out, first),
                                            daemon=True))
            threads[-1].start()
            http_results.append((out, first))
        for _, first in results + http_results:
            assert first.wait(120), "no first response before SIGTERM"

        server.proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        server.wait_event("shutdown_started", 30)
        check = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(prompt="hello"), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as refused_unary:
            stub.Tokenize(pb.TokenizeRequest(text="hello"), timeout=10)
        assert refused_unary.value.code() == grpc.StatusCode.UNAVAILABLE
        assert httpx.get(http + "/health", timeout=10).status_code == 503
        late = httpx.post(http + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"

        for thread in threads:
            thread.join(GRACE_S + 30)
        (short_out, _), (endless_out, _) = results
        assert short_out["code"] == grpc.StatusCode.OK
        assert short_out["responses"][-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in short_out["responses"]) == 4
        assert endless_out["code"] == grpc.StatusCode.OK
        last = endless_out["responses"][-1]
        assert last.finish_reason == pb.FINISH_REASON_ABORT and last.HasField("usage")
        assert 0 < last.usage.completion_tokens < 4000
        (http_short, _), (http_endless, _) = http_results
        assert http_short["status"] == http_endless["status"] == 200
        for out, reason in ((http_short, "length"), (http_endless, "abort")):
            assert out["events"][-1] == "[DONE]"
            chunks = [json.loads(e) for e in out["events"][:-1]]
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == reason
        assert server.proc.wait(timeout=60) == 0
        assert time.monotonic() - sent_at >= GRACE_S - 0.5  # the open stream held the drain for the whole grace
        assert any('"server_stopped"' in line for line in server.log)
        channel.close()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_a_model_that_cannot_load_exits_with_one_error_line():
    """A backend this machine lacks (cuda on a CPU) is found while loading: exit status 1 and one `pagedserve:
    error:` line naming it, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", "0", "--http-port", "0", "--embedding-model",
           "none", "--device", "cpu", "--attention-backend", "cuda", "--log-json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1
    assert "pagedserve: error: start-up failed: attention_backend 'cuda' needs a CUDA device" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
