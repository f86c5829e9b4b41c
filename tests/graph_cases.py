"""CUDA-graph decode steps against eager ones, shared by the GPU tests (tests/kernel_tests/gpu/test_cuda_graphs_gpu.py: real
graphs) and the host-emulator tests (tests/kernel_tests/test_cuda_graphs_simt.py: :class:`HostReplay` stands in for the graph
on CPU, the emulated cuda backend runs the kernels)."""
from __future__ import annotations

import random
import time

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.builder import build_engine
from pagedserve.sampling_params import SamplingParams


class HostReplay:
    """A CUDA graph's stand-in on CPU (``graph_factory`` of :class:`pagedserve.worker.cuda_graphs.CudaGraphForward`):
    :meth:`capture` runs ``fn`` once and records the kernel launches it made on the emulator ``sim``; :meth:`replay`
    reruns ``fn`` and asserts that it launched exactly those kernels with exactly that geometry and shared memory,
    which is what a real graph replays whatever the step's data."""

    def __init__(self, sim, pool=None, stream=None) -> None:
        self.sim, self.fn, self.launches = sim, None, None

    def _run(self):
        first = len(self.sim.launches)
        out = self.fn()
        return out, self.sim.launches[first:]

    def capture(self, fn) -> None:
        self.fn = fn
        _, self.launches = self._run()
        assert any(name.startswith("paged_decode_kernel") for name, *_ in self.launches)

    def replay(self) -> torch.Tensor:
        out, launches = self._run()
        assert launches == self.launches, "a replay launched other kernels or another geometry than the capture"
        return out


def random_prompts(count: int, vocab_size: int, seed: int, lengths=(3, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def engine_config(device: str, enforce_eager: bool, max_num_seqs: int, **overrides) -> EngineConfig:
    """fp32 (greedy ties cannot flip between the two decode launch plans), the cuda attention backend, a
    1024-token max_model_len (the graphs' fixed decode grid then splits a context into 8 partitions of 128)."""
    fields = dict(device=device, dtype="float32", attention_backend="cuda", num_kv_blocks=1200, max_model_len=1024,
                  max_num_batched_tokens=256, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager)
    return EngineConfig(**(fields | overrides))


def build(model, cfg, tokenizer, config: EngineConfig, backend=None):
    return build_engine(config, model=model, tokenizer=tokenizer, hf_config=cfg, backend=backend)


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int, tag: str = "r",
                  params: SamplingParams | None = None) -> dict[str, list[int]]:
    """Run ``prompts`` to completion (greedy, ``max_tokens`` each unless ``params``); request id -> tokens."""
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}{i}", ids, params)
    out: dict[str, list[int]] = {}
    for _ in range(100_000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
    return out


_runs = iter(range(1 << 30))


def decode_tpot_s(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Mean seconds per engine step once every request is decoding (TPOT at batch ``len(prompts)``): the prompts
    prefill first (untimed), then the remaining steps are timed. Each step ends in the sampler's host copy, so the
    device work is included."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    run = next(_runs)
    for i, ids in enumerate(prompts):
        engine.add_request(f"tpot{run}-{i}", ids, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(d.request_id for d in engine.step() if d.token_ids)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / max(1, steps)
