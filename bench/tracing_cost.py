"""Tracing's CPU cost per call, measured in one process without a server (bench/tracing_ab.py's served comparison
scatters by +-5% between runs; this counts the work itself, in CPU seconds of the threads that do it).

    .venv/bin/python bench/tracing_cost.py [--calls 2000] [--output-tokens 64] [--running 8]

For ``--calls`` calls, on the server's own classes (pagedserve.serving.tracing.Tracing, CallTrace,
pagedserve.engine.timings.TimingRecorder), exporting over OTLP/gRPC every 200 ms to an in-process collector as
bench/tracing_ab.py's ``on`` server does:

- per call, on the calling thread (the server's asyncio loop): the server span from a sampled ``traceparent``, its
  request attributes, the engine timings, the usage, the end (its preprocess / queue / prefill / prefill_chunk /
  decode children built from the times) -- ``time.thread_time``;
- per engine step, on the calling thread (the server's engine thread): ``TimingRecorder.on_step`` with
  ``--running`` traced requests in the step, each call seeing ``--output-tokens`` steps;
- the export: the SDK's batch span processor thread's CPU time (``pthread_getcpuclockid``), encoding and sending
  the spans, per call (flushed after every ``--running`` calls, so the queue never drops one; the flushing
  thread's own CPU in the flush counted too); the collector's (receiving) thread is not counted.

Printed: microseconds of each, and their sum per call as a share of what one call costs the server at the given
``--step-ms`` (a call is ``--output-tokens`` steps shared by ``--running`` calls, so it holds the server for
steps x step / running of its time; bench/tracing_ab.py's concurrency-8 runs step at about 24 ms on a 2-core AMD
EPYC Zen 4).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "service"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from otlp_collector import OtlpCollector  # noqa: E402
from pagedserve.engine.timings import TimingRecorder  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.serving.tracing import Tracing  # noqa: E402
from tracing_ab import traceparent  # noqa: E402  (the served comparison's caller context)


def export_threads_cpu_s() -> float:
    """CPU seconds of the OpenTelemetry batch processor's thread(s) so far."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threading.enumerate()
               if "otel" in t.name.lower() or "span" in t.name.lower())


class FakeRequest(types.SimpleNamespace):
    """What TimingRecorder reads of an engine Request (hashed by identity, as Request is)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def fake_request(i: int, timings) -> FakeRequest:
    return FakeRequest(request_id=f"r{i}", index=0, timings=timings, num_output_tokens=0, is_finished=False,
                       first_scheduled_time=None, num_cached_tokens=0, num_preemptions=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--running", type=int, default=8, help="traced requests in every step")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=24.0, help="the served step time the share is taken of")
    args = p.parse_args(argv)
    collector = OtlpCollector(keep=False)
    tracing = Tracing.from_config(collector.start(), {"OTEL_BSP_SCHEDULE_DELAY": "200"})
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0)
    recorder = TimingRecorder()
    call_s = step_s = flush_s = 0.0
    step_seconds = args.step_ms / 1e3   # the engine times the fake steps say (TimingRecorder only stores them)
    steps = 0
    export_before = export_threads_cpu_s()
    for batch in range(0, args.calls, args.running):
        n = min(args.running, args.calls - batch)
        t0 = time.thread_time()
        traces, requests = [], []
        for i in range(n):
            carrier = dict(traceparent(sampled=True))
            with tracing.traced(carrier, "pagedserve.v1.InferenceService/Generate",
                                {"rpc.system": "grpc"}) as trace:
                trace.describe("text_completion", "SmolLM2-135M-Instruct", params)
                timings = trace.engine_timings(f"r{batch + i}")
            traces.append(trace)
            requests.append(fake_request(batch + i, timings))
            recorder.add([requests[-1]], timings)
        call_s += time.thread_time() - t0
        now = time.monotonic()
        for k in range(args.output_tokens):   # step 0 is the prompt's (a prefill chunk), then the decodes
            composition = {r.request_id: (args.prompt_tokens if k == 0 else 1) for r in requests}
            for r in requests:
                r.first_scheduled_time = r.first_scheduled_time or now
                r.num_output_tokens += 1
                r.is_finished = k == args.output_tokens - 1
            t0 = time.thread_time()
            recorder.on_step(now + k * step_seconds, now + (k + 1) * step_seconds, composition)
            step_s += time.thread_time() - t0
            steps += 1
        t0 = time.thread_time()
        for trace in traces:
            trace.set_result(args.prompt_tokens, args.output_tokens, 0, ["length"])
            trace.end({"rpc.grpc.status_code": 0})
        call_s += time.thread_time() - t0
        t0 = time.thread_time()
        tracing.force_flush()   # one export per batch of calls (about what 200 ms holds served), none dropped
        flush_s += time.thread_time() - t0   # the SDK may export on the flushing thread itself
    tracing.force_flush()
    export_s = export_threads_cpu_s() - export_before + flush_s
    received = collector.num_spans
    tracing.shutdown()
    collector.stop()
    per_call_us = call_s / args.calls * 1e6
    per_step_us = step_s / steps * 1e6
    export_us = export_s / args.calls * 1e6
    total_us = per_call_us + per_step_us * args.output_tokens / args.running + export_us
    held_us = args.output_tokens * args.step_ms * 1e3 / args.running
    print(f"{args.calls} calls, {received} spans received ({received / args.calls:.1f} per call), "
          f"{args.output_tokens} output tokens, {args.running} traced requests a step")
    print(f"per call on the loop thread: {per_call_us:.0f} us; per step on the engine thread: {per_step_us:.1f} us "
          f"({per_step_us / (args.step_ms * 1e3) * 100:.3f}% of a {args.step_ms:g} ms step); export: "
          f"{export_us:.0f} us per call")
    print(f"tracing's CPU per call: {total_us:.0f} us, {total_us / held_us * 100:.2f}% of the {held_us / 1e3:.0f} ms "
          f"of server time a call holds at {args.step_ms:g} ms steps (of one core's; the server has two)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
