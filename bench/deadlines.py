"""Deadline scheduling under overload: goodput with the deadline policy vs with deadlines ignored, in one run.

    python bench/deadlines.py [--duration-s 40] [--batch 8] [--overload 2.0] [--slack 2.0]

Runs the engine in-process on the embedded model (CPU, fp32, the default kernels). First it measures the service
rate: ``--batch`` requests (64-token random prompts, 32 output tokens, EOS ignored) run to the end together; that
gives the time one batch takes (T) and the capacity (batch / T requests/s). Then the same open-loop workload runs
twice, once per mode, on fresh engines (bench/engine_load.py's driver) with ``max_num_seqs = --batch``: Poisson arrivals at ``--overload`` x
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
import random
import statistics
import time

from engine_load import Arrival, EmbeddedModel, batch_seconds, drive, poisson

OUTPUT_TOKENS = 32


def run_mode(model: EmbeddedModel, kept: bool, arrivals: list[Arrival], batch: int) -> dict:
    """One engine through the schedule; returns the mode's counts."""
    from pagedserve.errors import DeadlineError

    engine = model.engine(max_num_seqs=batch, deadline_scheduling=kept)
    done = {"in_time": 0, "refused": 0, "cancelled": 0, "cancelled_waiting": 0, "late": 0, "good_tokens": 0}
    tokens: dict[str, int] = {}

    def on_delta(a: Arrival, d, now: float) -> None:
        if d == "cancelled":
            admitted = engine.groups[a.request_id].children[0].first_scheduled_time is not None
            done["cancelled" if admitted else "cancelled_waiting"] += 1
        elif isinstance(d, DeadlineError) or d.error is not None:
            assert isinstance(d, DeadlineError) or isinstance(d.error, DeadlineError), d
            done["refused"] += 1
        else:
            tokens[a.request_id] = tokens.get(a.request_id, 0) + len(d.token_ids)
            if d.finish_reason is not None:
                in_time = now - start_of[0] <= a.at_s + a.deadline_s
                done["in_time" if in_time else "late"] += 1
                done["good_tokens"] += tokens[a.request_id] if in_time else 0

    start_of = [time.monotonic()]
    wall, queue = drive(engine, arrivals, OUTPUT_TOKENS, on_delta)
    done.update(wall_s=wall, goodput=done["good_tokens"] / wall, mean_queue=statistics.fmean(queue or [0]),
                refused_prefill_tokens=engine.stats()["deadline_refused_prefill_tokens"])
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

    model = EmbeddedModel()
    rng = random.Random(args.seed)
    probe = model.engine(max_num_seqs=args.batch)
    batch_s = batch_seconds(probe, args.batch, OUTPUT_TOKENS, rng)
    probe.close()
    capacity = args.batch / batch_s
    slack_s = args.slack * batch_s
    arrivals = [Arrival(t, f"r{i}", deadline_s=slack_s)
                for i, t in enumerate(poisson(args.overload * capacity, args.duration_s, rng))]
    print(f"one batch of {args.batch} (64-token prompts, {OUTPUT_TOKENS} output tokens): {batch_s:.2f} s; capacity "
          f"{capacity:.2f} req/s; arrivals {args.overload * capacity:.2f} req/s for {args.duration_s:.0f} s "
          f"({len(arrivals)} requests); deadline {slack_s:.2f} s after arrival")
    results = {}
    for name, kept in (("ignored", False), ("kept", True)):
        r = results[name] = run_mode(model, kept, arrivals, args.batch)
        print(f"  deadlines {name:8s} in time {r['in_time']:4d}  refused before prefill {r['refused']:4d} "
              f"(prefill tokens spent {r['refused_prefill_tokens']:.0f})  cancelled after admission "
              f"{r['cancelled']:4d} (while waiting {r['cancelled_waiting']})  finished late {r['late']:3d}  "
              f"mean queue {r['mean_queue']:5.1f} ({r['mean_queue'] / args.batch:.1f}x batch)  "
              f"goodput {r['goodput']:6.1f} tok/s")
    ratio = results["kept"]["goodput"] / max(results["ignored"]["goodput"], 1e-9)
    print(f"goodput kept / ignored: {ratio:.2f}x")


if __name__ == "__main__":
    main()
