"""Load test (issue 10): many concurrent Generate streams on loopback for a fixed time, mixed lengths and random
cancels. Prints requests, outcomes, errors by status code, the server's RSS (start, after warm-up, end, peak) and
the KV blocks free at the end.

    .venv/bin/python bench/load.py                      # 200 streams for 60 s against a fresh `pagedserve serve`
    .venv/bin/python bench/load.py --target 127.0.0.1:50051 --server-pid PID   # a server already running

Each of the ``--concurrency`` workers runs one stream after another until ``--duration-s`` is up. A request has a
prompt of ``4..--max-prompt-tokens`` random non-special token ids (a quarter of them start with one of four shared
64-token prefixes, so the prefix cache is used and evicted), ``max_tokens`` in ``1..--max-new-tokens``, greedy or
sampled, EOS ignored for half of them. Then one of: read to the end (70%), cancel after a random number of
messages (15%), cancel after a random delay (10%), or a deadline of a few milliseconds (5%).

When the time is up, the streams still open are cancelled (``CANCELLED_AT_END``). Expected outcomes are OK (with
exactly ``max_tokens`` tokens when EOS is ignored), CANCELLED for our cancels and DEADLINE_EXCEEDED for our
deadlines; anything else counts as an error under its status code (``WRONG_LENGTH``: OK with the wrong number of
tokens). At the end the script waits for the engine to go idle and reads GetModelInfo's ``kv_cache``. RSS is the server process's ``VmRSS`` sampled every 0.25 s (peak: the largest sample;
``VmHWM``, the peak since the process started, model loading included, is printed too); "after warm-up" is the
first sample past a quarter of the run. Exit status 1 when there were errors or blocks
were still held.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import grpc

from pagedserve_client import pb
from pagedserve_client.v1 import inference_pb2_grpc

MODES = (("full", 0.70), ("cancel_after_messages", 0.15), ("cancel_after_delay", 0.10), ("deadline", 0.05))
EXPECTED = {"full": {"OK"}, "cancel_after_messages": {"OK", "CANCELLED"}, "cancel_after_delay": {"OK", "CANCELLED"},
            "deadline": {"OK", "DEADLINE_EXCEEDED"}}
TOKEN_RANGE = (100, 49000)   # SmolLM2's special tokens are below 100


@dataclass(frozen=True)
class LoadConfig:
    """The workload; see the module docstring."""

    concurrency: int = 200          # streams open at once
    duration_s: float = 60.0        # no new stream starts after this
    max_prompt_tokens: int = 256    # prompt length drawn from 4..this
    max_new_tokens: int = 128       # max_tokens drawn from 1..this
    seed: int = 0


@dataclass
class LoadReport:
    """What one run measured (RSS in MiB)."""

    requests: int = 0                                       # streams started
    outcomes: dict = field(default_factory=dict)            # status name -> count, expected ones included
    errors: dict = field(default_factory=dict)              # unexpected status name -> count
    output_tokens: int = 0
    wall_s: float = 0.0
    rss_start_mib: float = 0.0
    rss_after_warmup_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_peak_mib: float = 0.0                               # largest sample during the run
    rss_hwm_mib: float = 0.0                                # VmHWM: the process's peak since it started
    blocks_free: int = 0
    blocks_total: int = 0

    @property
    def rss_growth_mib(self) -> float:
        """RSS at the end minus RSS after warm-up."""
        return self.rss_end_mib - self.rss_after_warmup_mib

    def summary(self) -> str:
        return (f"requests {self.requests}  outcomes {dict(sorted(self.outcomes.items()))}  "
                f"errors {dict(sorted(self.errors.items())) or 0}  output tokens {self.output_tokens}  "
                f"wall {self.wall_s:.1f} s\nRSS MiB: start {self.rss_start_mib:.0f}  after warm-up "
                f"{self.rss_after_warmup_mib:.0f}  end {self.rss_end_mib:.0f}  peak {self.rss_peak_mib:.0f}  "
                f"growth {self.rss_growth_mib:+.0f}  (VmHWM since start {self.rss_hwm_mib:.0f})\n"
                f"KV blocks free at the end: {self.blocks_free}/{self.blocks_total}")


def read_rss_mib(pid: int) -> tuple[float, float]:
    """``(VmRSS, VmHWM)`` of a process in MiB, from ``/proc/<pid>/status`` (Linux)."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def draw_request(rng: random.Random, cfg: LoadConfig, prefixes: list[list[int]]) -> pb.GenerateRequest:
    n_prompt = rng.randint(4, cfg.max_prompt_tokens)
    ids = [rng.randrange(*TOKEN_RANGE) for _ in range(n_prompt)]
    if rng.random() < 0.25:
        ids = rng.choice(prefixes) + ids
        ids = ids[:max(cfg.max_prompt_tokens, 68)]
    sampling = pb.SamplingParams(max_tokens=rng.randint(1, cfg.max_new_tokens), ignore_eos=rng.random() < 0.5,
                                 temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.randrange(2**32))
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling)


async def one_stream(stub, req: pb.GenerateRequest, mode: str, rng: random.Random,
                     end: float) -> tuple[str, int]:
    """Run one stream in ``mode``, cancelling it at ``end`` (monotonic s) if still open; returns (outcome name,
    tokens received). The outcome is ``CANCELLED_AT_END`` for a stream the end of the run cut off."""
    loop = asyncio.get_running_loop()
    call = stub.Generate(req, timeout=rng.uniform(0.002, 0.05) if mode == "deadline" else 600)
    tokens, messages = 0, 0
    stop_after = rng.randint(1, 8)
    delay = rng.uniform(0.0, 2.0) if mode == "cancel_after_delay" else None
    cut = [False]

    def cut_off():
        cut[0] = call.cancel()
    cancellers = [loop.call_later(max(0.0, end - time.monotonic()), cut_off)]
    if delay is not None:
        cancellers.append(loop.call_later(delay, call.cancel))
    try:
        async for msg in call:
            tokens += len(msg.token_ids)
            messages += 1
            if mode == "cancel_after_messages" and messages >= stop_after:
                call.cancel()
                break
    except grpc.aio.AioRpcError:
        pass
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
    finally:
        for canceller in cancellers:
            canceller.cancel()
    code = (await call.code()).name
    if cut[0] and code == "CANCELLED":
        return "CANCELLED_AT_END", tokens
    if code == "OK" and req.sampling.ignore_eos and tokens != req.sampling.max_tokens:
        code = "WRONG_LENGTH"
    return code, tokens


async def _worker(stub, rng: random.Random, cfg: LoadConfig, deadline: float, prefixes, report: LoadReport,
                  outcomes: collections.Counter) -> None:
    names, weights = zip(*MODES)
    while time.monotonic() < deadline:
        req = draw_request(rng, cfg, prefixes)
        mode = rng.choices(names, weights)[0]
        report.requests += 1
        code, tokens = await one_stream(stub, req, mode, rng, deadline)
        report.output_tokens += tokens
        outcomes[code] += 1
        if code not in EXPECTED[mode] and code != "CANCELLED_AT_END":
            report.errors[code] = report.errors.get(code, 0) + 1


async def _sample_rss(pid: int, samples: list) -> None:
    while True:
        samples.append((time.monotonic(), *read_rss_mib(pid)))
        await asyncio.sleep(0.25)


async def wait_idle_stats(stub, timeout_s: float = 120.0) -> pb.KVCacheStats:
    """GetModelInfo's kv_cache once no request is running or waiting (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)).kv_cache
        idle = stats.num_requests_running == 0 and stats.num_requests_waiting == 0
        if (idle and stats.num_blocks_free == stats.num_blocks_total) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def run_load(target: str, cfg: LoadConfig, server_pid: int) -> LoadReport:
    """Run the workload against ``target`` and measure ``server_pid``'s RSS; see the module docstring."""
    rng = random.Random(cfg.seed)
    prefixes = [[rng.randrange(*TOKEN_RANGE) for _ in range(64)] for _ in range(4)]
    report, outcomes, samples = LoadReport(), collections.Counter(), []
    sampler = asyncio.ensure_future(_sample_rss(server_pid, samples))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        start = time.monotonic()
        deadline = start + cfg.duration_s
        await asyncio.gather(*(_worker(stub, random.Random(rng.random()), cfg, deadline, prefixes, report, outcomes)
                               for _ in range(cfg.concurrency)))
        report.wall_s = time.monotonic() - start
        stats = await wait_idle_stats(stub)
    sampler.cancel()
    samples.append((time.monotonic(), *read_rss_mib(server_pid)))
    report.outcomes = dict(outcomes)
    report.blocks_free, report.blocks_total = stats.num_blocks_free, stats.num_blocks_total
    warm = next((s for s in samples if s[0] >= start + cfg.duration_s / 4), samples[-1])
    report.rss_start_mib, report.rss_after_warmup_mib, report.rss_end_mib = samples[0][1], warm[1], samples[-1][1]
    report.rss_peak_mib, report.rss_hwm_mib = max(s[1] for s in samples), samples[-1][2]
    return report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HOST:PORT of a running server (default: start `pagedserve serve`)")
    p.add_argument("--server-pid", type=int, help="with --target: the server's pid, for RSS")
    p.add_argument("--concurrency", type=int, default=LoadConfig.concurrency)
    p.add_argument("--duration-s", type=float, default=LoadConfig.duration_s)
    p.add_argument("--max-prompt-tokens", type=int, default=LoadConfig.max_prompt_tokens)
    p.add_argument("--max-new-tokens", type=int, default=LoadConfig.max_new_tokens)
    p.add_argument("--seed", type=int, default=LoadConfig.seed)
    p.add_argument("--threads", type=int, default=None, help="server torch threads (default: all CPUs)")
    p.add_argument("--json-out", help="also write the report as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = LoadConfig(args.concurrency, args.duration_s, args.max_prompt_tokens, args.max_new_tokens, args.seed)
    if args.target:
        if args.server_pid is None:
            sys.exit("--target needs --server-pid (RSS is read from /proc/<pid>/status)")
        report = asyncio.run(run_load(args.target, cfg, args.server_pid))
    else:
        import os

        import common

        with common.ServerProcess(args.threads or os.cpu_count() or 1) as server:   # the server's defaults
            report = asyncio.run(run_load(server.target, cfg, server.proc.pid))
    print(f"load: {asdict(cfg)}")
    print(report.summary())
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": asdict(cfg), **asdict(report), "rss_growth_mib": report.rss_growth_mib}, f, indent=1)
    return 1 if report.errors or report.blocks_free != report.blocks_total else 0


if __name__ == "__main__":
    sys.exit(main())
