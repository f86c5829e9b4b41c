"""Shared pieces of the in-process scheduling benchmarks (bench/deadlines.py, bench/fairness.py): the embedded
model loaded once, engines built on it, the measured time of one full batch, Poisson arrival schedules and an
open-loop driver that feeds an engine its arrivals on the wall clock and steps it."""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT_TOKENS = 64


@dataclass(frozen=True)
class Arrival:
    """One request of a schedule: when (seconds from the start), its id, caller and deadline slack."""

    at_s: float
    request_id: str
    caller: str = ""
    deadline_s: float | None = None   # seconds after arrival; None: no deadline


class EmbeddedModel:
    """The embedded model (quantization as served: "auto") and tokenizer, loaded once; :meth:`engine` builds
    engines on it (CPU, fp32 activations, the default kernels)."""

    def __init__(self):
        import torch

        from pagedserve.models.loader import ModelSource
        from pagedserve.models.registry import build_model

        src = ModelSource.resolve(None)
        self.cfg, self.tok = src.load_config(), src.load_tokenizer()
        self.model = build_model(src, self.cfg, torch.float32, "cpu", quantization="auto")

    def engine(self, **config):
        from pagedserve.config import EngineConfig
        from pagedserve.engine.builder import build_engine

        config = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 1024, **config}
        return build_engine(EngineConfig(**config), model=self.model, tokenizer=self.tok, hf_config=self.cfg)[0]


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)]


def batch_seconds(engine, batch: int, output_tokens: int, rng: random.Random) -> float:
    """Seconds ``batch`` requests (``output_tokens`` each, EOS ignored) take together on ``engine``, measured on
    the second of two batches (the first pays one-off costs)."""
    from pagedserve.sampling_params import SamplingParams

    for warm in range(2):
        start = time.monotonic()
        for i in range(batch):
            engine.add_request(f"probe{warm}-{i}", prompt(rng), SamplingParams(max_tokens=output_tokens,
                                                                                ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        seconds = time.monotonic() - start
    return seconds


def poisson(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds) of a Poisson process of ``rate`` per second over ``duration_s``."""
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) <= duration_s:
        out.append(t)
    return out


def drive(engine, arrivals: list[Arrival], output_tokens: int, on_delta: Callable, seed: int = 1,
          cancel_at_deadline: bool = True) -> tuple[float, list[int]]:
    """Feed ``engine`` its arrivals on the wall clock and step it until all are done. ``on_delta(arrival,
    delta_or_error, now)`` hears every delta (or the DeadlineError of a refusal at arrival). A request whose
    deadline passes is aborted, as its caller would cancel the call (``on_delta`` gets the string "cancelled").
    Returns (wall seconds, waiting-queue length before each step)."""
    from pagedserve.errors import DeadlineError
    from pagedserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    live: dict[str, tuple[Arrival, float | None]] = {}
    queue = []
    start = time.monotonic()
    i = 0
    while i < len(arrivals) or engine.has_unfinished():
        now = time.monotonic()
        while i < len(arrivals) and start + arrivals[i].at_s <= now:
            a = arrivals[i]
            deadline = start + a.at_s + a.deadline_s if a.deadline_s is not None else None
            try:
                engine.add_request(a.request_id, prompt(rng), params, deadline=deadline, caller=a.caller)
                live[a.request_id] = (a, deadline)
            except DeadlineError as exc:
                on_delta(a, exc, now)
            i += 1
        expired = [rid for rid, (_, d) in live.items() if cancel_at_deadline and d is not None and d <= now]
        for rid in expired:
            on_delta(live.pop(rid)[0], "cancelled", now)
        if expired:
            engine.abort(expired)
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        queue.append(engine.scheduler.num_waiting)
        for delta in engine.step():
            entry = live.get(delta.request_id)
            if entry is None:
                continue
            on_delta(entry[0], delta, time.monotonic())
            if delta.error is not None or delta.finish_reason is not None:
                live.pop(delta.request_id)
    return time.monotonic() - start, queue
