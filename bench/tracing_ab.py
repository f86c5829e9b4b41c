"""Tracing's cost, served: TPOT and TTFT with OpenTelemetry tracing on (every call sampled, spans exported over OTLP
to an in-process collector) against off, alternating on the same machine in one run.

    .venv/bin/python bench/tracing_ab.py [--rounds 4] [--concurrency 1,8] [--max-new-tokens 64] [--threads 2]

Two `pagedserve serve` processes (embedded models, default flags) are up at the same time and driven one at a time,
``off, on, on, off, off, on, ...`` per concurrency, so both see the machine in the same state:

- ``off``: no ``--otlp-traces-endpoint``; its environment still names a second collector in
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the SDK's own variable), which must receive no span: tracing is off unless
  the flag is given.
- ``on``: ``--otlp-traces-endpoint`` at the first collector, ``OTEL_TRACES_SAMPLER=always_on`` (every call traced),
  ``OTEL_BSP_SCHEDULE_DELAY=200`` (exports every 200 ms, so export work falls inside the measured runs).

Each run is ``--requests`` gRPC Generate streams (greedy, exactly ``--max-new-tokens`` tokens, a new cache salt per
run, so no run hits an earlier run's prefix cache) at the given concurrency. Printed per concurrency: each side's
TPOT p50 and TTFT p50 (median over its rounds), the ratio on / off (the issue's bar: TPOT p50 within 3%), and the
spans each collector received (on: one or more per call; off: 0). ``--aa`` starts the second server with tracing off
too (an A/A run): its on/off ratios are what two server processes differ by on this machine, the noise floor of
the comparison.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import uuid

import common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from otlp_collector import OtlpCollector  # noqa: E402  (the tests' collector, count-only here)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="runs per side and concurrency")
    p.add_argument("--concurrency", default="1,8", help="comma-separated")
    p.add_argument("--requests", type=int, default=0, help="streams per run (default: 8 x concurrency, >= 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--aa", action="store_true",
                   help="A/A: the second server with tracing off too, to size what two processes differ by")
    return p.parse_args(argv)


def one_run(server: common.ServerProcess, requests: list, concurrency: int) -> dict:
    records, _ = asyncio.run(common.run_streams(server.target, requests, concurrency, cache_salt=uuid.uuid4().hex))
    return common.latency_summary(records)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = common.configure_threads(args.threads)
    tokenizer = common.load_tokenizer()
    traced, stray = OtlpCollector(keep=False), OtlpCollector(keep=False)
    traced_url, stray_url = traced.start(), stray.start()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = stray_url        # seen by the "off" server only
    off = common.ServerProcess(args.threads)
    del os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    os.environ.update(OTEL_TRACES_SAMPLER="always_on", OTEL_BSP_SCHEDULE_DELAY="200")
    on = common.ServerProcess(args.threads, [] if args.aa else ["--otlp-traces-endpoint", traced_url])
    for key in ("OTEL_TRACES_SAMPLER", "OTEL_BSP_SCHEDULE_DELAY"):
        del os.environ[key]
    print(f"threads {args.threads}, load before {settings['loadavg_1m_before']}; {args.rounds} rounds per side, "
          f"{args.max_new_tokens} output tokens per stream" + ("; A/A: 'on' is a second server with tracing off"
                                                               if args.aa else ""))
    rows = []
    with off, on:
        warm = [common.warmup_request(tokenizer)]
        for server in (off, on):
            one_run(server, warm, 1)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            n = args.requests or max(8, 8 * concurrency)
            requests = common.quick_workload(tokenizer, n, args.max_new_tokens)
            results: dict[str, list[dict]] = {"off": [], "on": []}
            spans_before = traced.num_spans
            for r in range(args.rounds):
                order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
                for name, server in order:
                    results[name].append(one_run(server, requests, concurrency))
            med = {name: {k: statistics.median(run[k] for run in runs) for k in ("tpot_ms_p50", "ttft_ms_p50")}
                   for name, runs in results.items()}
            rows.append((concurrency, n, med, traced.num_spans - spans_before))
            print(f"  concurrency {concurrency:2d} ({n} streams x {args.rounds} rounds): "
                  f"TPOT p50 off {med['off']['tpot_ms_p50']:.2f} ms, on {med['on']['tpot_ms_p50']:.2f} ms, "
                  f"on/off {med['on']['tpot_ms_p50'] / med['off']['tpot_ms_p50']:.3f}; "
                  f"TTFT p50 off {med['off']['ttft_ms_p50']:.1f} ms, on {med['on']['ttft_ms_p50']:.1f} ms, "
                  f"on/off {med['on']['ttft_ms_p50'] / med['off']['ttft_ms_p50']:.3f}; "
                  f"spans received {traced.num_spans - spans_before}", flush=True)
    traced.stop()
    stray.stop()
    print(f"spans at the off server's OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: {stray.num_spans} (want 0)")
    worst = max(abs(m["on"]["tpot_ms_p50"] / m["off"]["tpot_ms_p50"] - 1) for _, _, m, _ in rows)
    print(f"largest TPOT p50 difference on vs off: {worst * 100:.1f}% (bar: 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
