"""Tensor parallelism on a random-weight Llama with 4 query and 2 KV heads (fast to load in every rank): size 2
equals size 1 and HF; a killed worker ends a live stream with UNAVAILABLE within the collective timeout and turns
health NOT_SERVING, a hung one after the timeout; after SIGTERM no process of the server is left (by PID); two torchrun "nodes" (2 x 1 process)
serve a request end to end."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from support import ServerThread, free_port, wait_until
from tp_cases import ExecutorModel, greedy_over_grpc, prefill_logits, save_random_llama

pytestmark = pytest.mark.e2e

SERVICE = "pagedserve.v1.InferenceService"
COLLECTIVE_TIMEOUT_S = 20.0
PROMPTS = [[random.Random(i).randrange(2, 512) for _ in range(n)] for i, n in enumerate([5, 17, 40, 3])]


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tp_llama"))
    save_random_llama(d, num_heads=4, num_kv_heads=2)
    return d


@pytest.fixture(scope="module")
def hf_random(random_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(random_dir, dtype=torch.float32).eval()


def engine_config(random_dir, **kwargs):
    from pagedserve.config import EngineConfig
    return EngineConfig(model=random_dir, device="cpu", dtype="float32", attention_backend="torch",
                        quantization="none", num_kv_blocks=256, max_model_len=2048, max_num_seqs=8, **kwargs)


@pytest.fixture(scope="module")
def tp2_server(random_dir):
    from pagedserve.config import ServerConfig

    s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model=""),
                     engine_config(random_dir, tensor_parallel_size=2, collective_timeout_s=COLLECTIVE_TIMEOUT_S))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tp2_client(tp2_server):
    from pagedserve_client import PagedServeClient

    with PagedServeClient(tp2_server.target, timeout_s=300) as c:
        yield c


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_size2_equals_size1_and_hf(tp2_server, tp2_client, random_dir, hf_random):
    from pagedserve.engine.builder import build_engine
    from pagedserve.models.interface import CausalLM

    assert tp2_client.model_info().generation.tensor_parallel_size == 2
    tp_model = ExecutorModel(tp2_server.engine.executor)
    assert tp_model.num_kv_heads == 1 and tp_model.num_layers == 2
    one, _ = build_engine(engine_config(random_dir), tokenizer=tp2_server.engine.tokenizer)
    assert isinstance(tp2_server.engine.executor.model, CausalLM) and isinstance(one.executor.model, CausalLM)  # the model contract
    for ids in PROMPTS[:2]:
        logits2, logits1 = prefill_logits(tp_model, ids), prefill_logits(one.executor.model, ids)
        with torch.inference_mode():
            ref = hf_random(torch.tensor([ids])).logits[0].float()
        assert (logits2 - ref).abs().max().item() < 1e-4
        assert (logits2 - logits1).abs().max().item() < 1e-4
    got = greedy_over_grpc(tp2_client, PROMPTS, 24)
    assert len({tuple(g) for g in got}) > 1, "outputs should depend on the prompt"
    assert got == [hf_greedy(hf_random, ids, 24) for ids in PROMPTS]


def test_beam_search_at_size2_equals_size1(tp2_client, random_dir):
    """Beam search (beams forking partial blocks, copy-on-write on every rank's caches) at size 2 returns size 1's
    sequences in the same order with the same scores."""
    from pagedserve.config import ServerConfig
    from pagedserve_client import PagedServeClient

    one = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model=""),
                       engine_config(random_dir))
    try:
        with PagedServeClient(one.target, timeout_s=120) as c1:
            for ids in PROMPTS[:2]:
                kwargs = dict(prompt_token_ids=ids, max_tokens=20, n=2, beam_search={"beam_width": 3})
                got2 = [(r.index, list(r.token_ids), r.cumulative_logprob) for r in tp2_client.generate(**kwargs)]
                got1 = [(r.index, list(r.token_ids), r.cumulative_logprob) for r in c1.generate(**kwargs)]
                assert [g[:2] for g in got2] == [g[:2] for g in got1]
                assert all(abs(a[2] - b[2]) < 1e-4 for a, b in zip(got2, got1))
    finally:
        one.stop()


def signal_worker_mid_stream(client, pid: int, sig: int) -> tuple[grpc.RpcError, float]:
    """Start a long greedy stream, send ``sig`` to worker ``pid`` after its first message, and read on until the
    stream fails: returns the error and the seconds from the signal to the failure (the test fails if the stream
    ends without one)."""
    stream = iter(client.generate(prompt_token_ids=PROMPTS[0], temperature=0.0, max_tokens=1800, min_tokens=1800))
    next(stream)
    os.kill(pid, sig)
    sent = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    return err.value, time.monotonic() - sent


def test_killed_worker_gives_unavailable_and_not_serving(tp2_server, tp2_client):
    """Runs last in this module: it breaks the shared size-2 server on purpose."""
    pid = tp2_server.engine.executor.processes[0].pid
    err, detected_s = signal_worker_mid_stream(tp2_client, pid, signal.SIGKILL)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert detected_s < COLLECTIVE_TIMEOUT_S
    wait_until(lambda: tp2_client.health(SERVICE) == "NOT_SERVING", 10, "health should turn NOT_SERVING")
    with pytest.raises(grpc.RpcError) as err:
        list(tp2_client.generate(prompt_token_ids=PROMPTS[1], max_tokens=2))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    print(f"\nkilled worker detected after {detected_s:.3f} s")


def test_hung_worker_fails_calls_after_the_collective_timeout(random_dir):
    """A worker stopped (SIGSTOP) mid-stream: rank 0's all-reduce gives up after --collective-timeout-s (5 s
    here), the stream ends with UNAVAILABLE, health turns NOT_SERVING, and the stopped worker is killed."""
    from pagedserve.config import ServerConfig
    from pagedserve_client import PagedServeClient

    timeout_s = 5.0
    server = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model=""),
                          engine_config(random_dir, tensor_parallel_size=2, collective_timeout_s=timeout_s))
    try:
        pid = server.engine.executor.processes[0].pid
        with PagedServeClient(server.target, timeout_s=120) as c:
            err, detected_s = signal_worker_mid_stream(c, pid, signal.SIGSTOP)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert timeout_s * 0.9 <= detected_s < 4 * timeout_s, detected_s
            wait_until(lambda: c.health(SERVICE) == "NOT_SERVING", 10, "health should turn NOT_SERVING")
        wait_until(lambda: not alive(pid), 15, "the hung worker should be killed")
        print(f"\nhung worker detected after {detected_s:.2f} s (collective timeout {timeout_s} s)")
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        server.stop()


def children_of(pid: int) -> set[int]:
    """Every descendant PID of ``pid`` (from /proc/<pid>/task/*/children)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.exists(f"/proc/{p}/task") else []:
            try:
                kids = open(f"/proc/{p}/task/{task}/children").read().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_leaves_no_worker(random_dir):
    from support import ServerProcess

    server = ServerProcess("--model", random_dir, "--quantization", "none", "--tensor-parallel-size", "2",
                           "--num-kv-blocks", "64")
    try:
        ready_tp = server.wait_event("tensor_parallel_ready", 300)
        ready = server.wait_event("ready", 300)
        assert ready["tensor_parallel_size"] == 2
        workers = set(ready_tp["worker_pids"])
        descendants = children_of(server.proc.pid)
        assert workers and workers <= descendants
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        wait_until(lambda: not any(alive(p) for p in descendants), 15,
                   lambda: f"left: {[p for p in descendants if alive(p)]}")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_two_torchrun_nodes_serve_a_request(random_dir, hf_random):
    from pagedserve_client import PagedServeClient

    grpc_port, master_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    serve = ["-m", "pagedserve.torchrun", "serve", "--port", str(grpc_port), "--http-port", "0",
             "--embedding-model", "none", "--model", random_dir, "--tensor-parallel-size", "2", "--device", "cpu",
             "--dtype", "float32", "--attention-backend", "torch", "--quantization", "none", "--num-kv-blocks", "64"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "1", "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port",
                               str(master_port), *serve], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in (0, 1)]
    try:
        with PagedServeClient(f"127.0.0.1:{grpc_port}", timeout_s=120) as c:
            def serving():
                assert all(n.poll() is None for n in nodes), [n.poll() for n in nodes]
                try:
                    return c.health(SERVICE, timeout=2) == "SERVING"
                except grpc.RpcError:
                    return False
            wait_until(serving, 300, "the torchrun job should serve")
            assert c.model_info().generation.tensor_parallel_size == 2
            assert greedy_over_grpc(c, PROMPTS[2:3], 16) == [hf_greedy(hf_random, PROMPTS[2], 16)]
        server_pid = min(children_of(nodes[0].pid))    # rank 0: torchrun's one child on node 0
        os.kill(server_pid, signal.SIGTERM)               # the server stops, and with it the rank on node 1
        assert [n.wait(60) for n in nodes] == [0, 0]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
