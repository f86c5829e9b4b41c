"""Deadline scheduling under overload: goodput with the deadline policy vs with deadlines ignored, in one run.

    python bench/deadlines.py [--duration-s 40] [--batch 8] [--overload 2.0] [--slack 2.0]

Runs the engine in-process on the embedded model (CPU, fp32, the default kernels). First it measures the service
rate: ``--batch`` requests (64-token random prompts, 32 output tokens, EOS ignored) run to the end together; that
gives the time one batch takes (T) and the capacity (batch / T requests/s). Then the same open-loop workload runs
twice, once per mode, on fresh engines with ``max_num_seqs = --batch``: Poisson arrivals at ``--overload`` x
capacity for ``--duration-s``, each request with a deadline of ``--slack`` x T after its arrival (a request served at
once meets it with room; one that waits behind a long queue does not). As a client would, the driver cancels a
request whose deadline passes (an aborted gRPC call).

- ``ignored`` (``deadline_scheduling=False``): today's behaviour before this policy: arrival order, requests run
  until their caller gives up.
- ``kept`` (the default): EDF within the priority, and refusal before prefill of what cannot finish in time.

Printed per mode: requests finished in time, refused before prefill (with the prefill tokens they had spent, 0 by
design), cancelled by their own deadline after admission, the mean waiting-queue length (against the batch), and
goodput (output tokens of requests that finished by their deadline per second of the run); then the ratio kept /
ignored.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)]


def run_mode(make_engine, kept: bool, arrivals: list[float], slack_s: float, seed: int) -> dict:
    """Drive one engine through the arrival schedule (seconds from start); returns the mode's counts."""
    from pagedserve.errors import DeadlineError
    from pagedserve.sampling_params import SamplingParams

    engine = make_engine(kept)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    live: dict[str, float] = {}          # request id -> deadline (monotonic)
    tokens: dict[str, int] = {}
    done = {"in_time": 0, "refused": 0, "cancelled": 0, "cancelled_waiting": 0, "late": 0, "good_tokens": 0}
    queue_samples = []
    start = time.monotonic()
    next_i = 0
    while next_i < len(arrivals) or engine.has_unfinished():
        now = time.monotonic()
        while next_i < len(arrivals) and start + arrivals[next_i] <= now:
            rid = f"r{next_i}"
            deadline = start + arrivals[next_i] + slack_s
            try:
                engine.add_request(rid, _prompt(rng), params, deadline=deadline)
                live[rid], tokens[rid] = deadline, 0
            except DeadlineError:
                done["refused"] += 1
            next_i += 1
        expired = [rid for rid, d in live.items() if d <= now]  # the caller gives up: its call is cancelled
        if expired:
            for rid in expired:
                admitted = engine.groups[rid].children[0].first_scheduled_time is not None
                done["cancelled" if admitted else "cancelled_waiting"] += 1
                live.pop(rid)
            engine.abort(expired)
        if not engine.has_unfinished():
            time.sleep(0.002)
            continue
        queue_samples.append(engine.scheduler.num_waiting)
        for d in engine.step():
            if d.request_id not in live:
                continue
            if d.error is not None:
                assert isinstance(d.error, DeadlineError), d.error
                live.pop(d.request_id)
                done["refused"] += 1
                continue
            tokens[d.request_id] += len(d.token_ids)
            if d.finish_reason is not None:
                in_time = time.monotonic() <= live.pop(d.request_id)
                done["in_time" if in_time else "late"] += 1
                done["good_tokens"] += tokens[d.request_id] if in_time else 0
    wall = time.monotonic() - start
    stats = engine.stats()
    done.update(wall_s=wall, goodput=done["good_tokens"] / wall, mean_queue=statistics.fmean(queue_samples or [0]),
                refused_prefill_tokens=stats["deadline_refused_prefill_tokens"])
    engine.close()
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--batch", type=int, default=8, help="max_num_seqs")
    parser.add_argument("--overload", type=float, default=2.0, help="arrival rate / measured capacity")
    parser.add_argument("--slack", type=float, default=2.0, help="deadline / time one batch takes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model
    from pagedserve.sampling_params import SamplingParams

    src = ModelSource.resolve(None)
    cfg, tok = src.load_config(), src.load_tokenizer()
    model = build_model(src, cfg, torch.float32, "cpu", quantization="auto")

    def make_engine(kept: bool):
        config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=args.batch, num_kv_blocks=1024,
                              deadline_scheduling=kept)
        return build_engine(config, model=model, tokenizer=tok, hf_config=cfg)[0]

    rng = random.Random(args.seed)
    probe = make_engine(True)
    for warm in range(2):   # the first batch pays one-off costs; the second is the measurement
        t0 = time.monotonic()
        for i in range(args.batch):
            probe.add_request(f"w{warm}-{i}", _prompt(rng), SamplingParams(max_tokens=OUTPUT_TOKENS,
                                                                            ignore_eos=True))
        while probe.has_unfinished():
            probe.step()
        batch_s = time.monotonic() - t0
    probe.close()
    capacity = args.batch / batch_s
    rate = args.overload * capacity
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > args.duration_s:
            break
        arrivals.append(t)
    slack_s = args.slack * batch_s
    print(f"one batch of {args.batch} ({PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens): "
          f"{batch_s:.2f} s; capacity {capacity:.2f} req/s; arrivals {rate:.2f} req/s for {args.duration_s:.0f} s "
          f"({len(arrivals)} requests); deadline {slack_s:.2f} s after arrival")
    results = {}
    for name, kept in (("ignored", False), ("kept", True)):
        r = run_mode(make_engine, kept, arrivals, slack_s, args.seed + 1)
        results[name] = r
        print(f"  deadlines {name:8s} in time {r['in_time']:4d}  refused before prefill {r['refused']:4d} "
              f"(prefill tokens spent {r['refused_prefill_tokens']:.0f})  cancelled after admission "
              f"{r['cancelled']:4d} (waiting {r['cancelled_waiting']})  finished late {r['late']:3d}  mean queue {r['mean_queue']:5.1f} "
              f"({r['mean_queue'] / args.batch:.1f}x batch)  goodput {r['goodput']:6.1f} tok/s")
    ratio = results["kept"]["goodput"] / max(results["ignored"]["goodput"], 1e-9)
    print(f"goodput kept / ignored: {ratio:.2f}x")


if __name__ == "__main__":
    main()
