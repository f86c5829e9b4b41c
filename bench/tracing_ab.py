"""Tracing's cost, served: TPOT and TTFT with OpenTelemetry tracing on (every call sampled, spans exported over OTLP
to an in-process collector) against off, alternating on the same machine in one run.

    .venv/bin/python bench/tracing_ab.py [--sets 1] [--rounds 4] [--aa] [--concurrency 1,8] [--max-new-tokens 64]

`pagedserve serve` processes (embedded models, default flags) are up at the same time and driven one at a time, in
an order rotated every round (``off, on, on, off, off, on, ...`` for two), per concurrency, so all see the machine
in the same state:

- ``off``: no ``--otlp-traces-endpoint``; its environment still names a second collector in
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the SDK's own variable), which must receive no span: tracing is off unless
  the flag is given.
- ``on``: ``--otlp-traces-endpoint`` at the first collector, the default sampler (``parentbased_always_on``),
  ``OTEL_BSP_SCHEDULE_DELAY=200`` (exports every 200 ms, so export work falls inside the measured runs); its calls
  carry a sampled W3C ``traceparent`` of a new trace each (a traced caller in a mesh): every call traced.
- ``unsampled``: the same ``on`` server process, its calls carrying an unsampled ``traceparent`` (flags 00): no
  span recorded or exported, the engine notes no times. on/unsampled is tracing's cost within one process, free
  of what two server processes differ by (up to 10-15% in TPOT on the 2-core guests of bench/README.md).
- ``off2`` (with ``--aa``): a third server, configured as ``off``: off2/off is what two server processes differ by
  on this machine in this run (an A/A comparison), the noise floor of on/off.

Each run is ``--requests`` gRPC Generate streams (greedy, exactly ``--max-new-tokens`` tokens, a new cache salt per
run, so no run hits an earlier run's prefix cache) at the given concurrency. ``--sets K`` starts K fresh sets of
server processes one after the other (the start order rotated) and pools their runs, so one process that happens to
run faster or slower than its twin weighs 1/K. Printed per concurrency: each side's TPOT p50 and TTFT p50 (median
over its runs), the ratios to ``off`` and on/unsampled (the issue's bar: TPOT p50 with tracing on within 3% of
off), and the spans each collector received (on: six per call; off and unsampled: 0).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    p.add_argument("--sets", type=int, default=1,
                   help="sets of fresh server processes, run one after the other and pooled (process-to-process "
                        "differences average out)")
    p.add_argument("--aa", action="store_true",
                   help="A/A too: a third server with tracing off (off2), to size what two processes differ by")
    return p.parse_args(argv)


def traceparent(sampled: bool) -> list[tuple[str, str]]:
    """A W3C traceparent of a new trace (a caller's span), sampled flag set or not."""
    return [("traceparent", f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-{'01' if sampled else '00'}")]


# side -> (server, traceparent's sampled flag): "on" and "unsampled" are calls to the same traced server
SIDES = {"off": ("off", True), "on": ("on", True), "unsampled": ("on", False), "off2": ("off2", True)}


def one_run(server: common.ServerProcess, requests: list, concurrency: int, sampled: bool = True) -> dict:
    records, _ = asyncio.run(common.run_streams(server.target, requests, concurrency, cache_salt=uuid.uuid4().hex,
                                                metadata=lambda: traceparent(sampled)))
    return common.latency_summary(records)


def start_servers(args, traced_url: str, stray_url: str, first: int) -> dict[str, common.ServerProcess]:
    """The servers of one set (not started yet): ``off``, ``on`` and with ``--aa`` ``off2``, in start order rotated by
    ``first`` so no side is always the first process started."""
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = stray_url        # seen by the off servers only
    servers = {"off": common.ServerProcess(args.threads)}
    if args.aa:
        servers["off2"] = common.ServerProcess(args.threads)
    del os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    servers["on"] = common.ServerProcess(args.threads, ["--otlp-traces-endpoint", traced_url])
    del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    names = list(servers)
    names = names[first % len(names):] + names[:first % len(names)]
    return {name: servers[name] for name in names}


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = common.configure_threads(args.threads)
    tokenizer = common.load_tokenizer()
    traced, stray = OtlpCollector(keep=False), OtlpCollector(keep=False)
    traced_url, stray_url = traced.start(), stray.start()
    print(f"threads {args.threads}, load before {settings['loadavg_1m_before']}; {args.sets} set(s) of fresh server "
          f"processes x {args.rounds} rounds per side, {args.max_new_tokens} output tokens per stream"
          + ("; A/A: 'off2' is a third server with tracing off" if args.aa else ""))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results: dict[int, dict[str, list[dict]]] = {c: {} for c in concurrencies}
    spans = {c: 0 for c in concurrencies}
    for k in range(args.sets):
        servers = start_servers(args, traced_url, stray_url, k)
        names = [side for side, (server, _) in SIDES.items() if server in servers]   # the sides these servers take
        with contextlib.ExitStack() as stack:
            for server in servers.values():
                stack.enter_context(server)
            for server in servers.values():
                one_run(server, [common.warmup_request(tokenizer)], 1)
            for concurrency in concurrencies:
                requests = common.quick_workload(tokenizer, n_streams(args, concurrency), args.max_new_tokens)
                spans_before = traced.num_spans
                for r in range(args.rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for name in order:
                        server, sampled = SIDES[name]
                        results[concurrency].setdefault(name, []).append(
                            one_run(servers[server], requests, concurrency, sampled))
                spans[concurrency] += traced.num_spans - spans_before
        print(f"  set {k + 1}/{args.sets} done", flush=True)
    traced.stop()
    stray.stop()
    worst = 0.0
    for concurrency in concurrencies:
        med = {name: {key: statistics.median(run[key] for run in runs) for key in ("tpot_ms_p50", "ttft_ms_p50")}
               for name, runs in results[concurrency].items()}
        parts = []
        for key, unit, fmt in (("tpot_ms_p50", "TPOT", ".2f"), ("ttft_ms_p50", "TTFT", ".1f")):
            part = f"{unit} p50 off {med['off'][key]:{fmt}} ms"
            for name in [n for n in ("on", "unsampled", "off2") if n in med]:
                part += f", {name} {med[name][key]:{fmt}} ms ({name}/off {med[name][key] / med['off'][key]:.3f})"
            parts.append(part + f", on/unsampled {med['on'][key] / med['unsampled'][key]:.3f}")
        print(f"  concurrency {concurrency:2d} ({n_streams(args, concurrency)} streams x {args.sets * args.rounds} "
              f"runs per side): {'; '.join(parts)}; spans received {spans[concurrency]}", flush=True)
        worst = max(worst, abs(med["on"]["tpot_ms_p50"] / med["unsampled"]["tpot_ms_p50"] - 1))
    print(f"spans at the off servers' OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: {stray.num_spans} (want 0)")
    print(f"largest TPOT p50 difference on vs unsampled (one process): {worst * 100:.1f}% (bar: 3%)")
    return 0


def n_streams(args, concurrency: int) -> int:
    return args.requests or max(8, 8 * concurrency)


if __name__ == "__main__":
    sys.exit(main())
