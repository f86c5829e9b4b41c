"""`pagedserve-client bench`: a closed-loop latency benchmark over Generate.

``concurrency`` threads each keep one Generate stream open, until ``num_requests`` requests have run. Every
request is timed on the client (monotonic clock): TTFT is the call to the first response carrying tokens, TPOT is
(last token time - first token time) / (tokens - 1), end-to-end is the call to the end of the stream. The report
(JSON) holds every request's timings and the summary (mean and p50/p90/p99, token throughput); the PNG plots the
TTFT and TPOT distributions. tqdm draws the progress bar; matplotlib (extra ``bench``) draws the plot.
"""
from __future__ import annotations

import json
import math
import pathlib
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from .client import PagedServeClient

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class RequestTiming:
    """One request as the client saw it (seconds)."""

    ttft_s: float | None          # None when no token arrived
    tpot_s: float | None          # None with fewer than two tokens
    e2e_s: float
    completion_tokens: int        # tokens received
    prompt_tokens: int            # from the final usage (0 when the call failed)
    code: str                     # "OK" or the gRPC status name


def time_one(client: PagedServeClient, prompt: str, sampling: dict[str, Any]) -> RequestTiming:
    """Run one Generate stream to its end and time it. gRPC errors are recorded in ``code``, never raised."""
    start = time.monotonic()
    first = last = None
    tokens = prompt_tokens = 0
    code = "OK"
    try:
        for response in client.generate(prompt, **sampling):
            if response.token_ids:
                last = time.monotonic()
                first = first if first is not None else last
                tokens += len(response.token_ids)
            if response.HasField("usage"):
                prompt_tokens = response.usage.prompt_tokens
    except grpc.RpcError as err:
        code = err.code().name
    end = time.monotonic()
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return RequestTiming(None if first is None else first - start, tpot, end - start, tokens, prompt_tokens, code)


def run_bench(client: PagedServeClient, prompts: list[str], num_requests: int, concurrency: int,
              sampling: dict[str, Any], progress: bool = True) -> tuple[list[RequestTiming], float]:
    """Run the load; returns (timings in completion order, wall seconds). Request i uses prompts[i % len]."""
    from tqdm import tqdm

    start = time.monotonic()
    timings = []
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench") as pool:
        futures = [pool.submit(time_one, client, prompts[i % len(prompts)], sampling) for i in range(num_requests)]
        with tqdm(total=num_requests, desc="bench", unit="req", disable=not progress) as bar:
            for future in as_completed(futures):
                timings.append(future.result())
                bar.update()
    return timings, time.monotonic() - start


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty list, q in (0, 100]."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "p50": _percentile(values, 50), "p90": _percentile(values, 90),
            "p99": _percentile(values, 99), "max": max(values)}


def summarize(timings: list[RequestTiming], wall_s: float) -> dict[str, Any]:
    """Counts, latency statistics (seconds) and throughput of a run."""
    ok = [t for t in timings if t.code == "OK"]
    tokens = sum(t.completion_tokens for t in ok)
    return {
        "requests": len(timings), "ok": len(ok), "errors": len(timings) - len(ok), "wall_s": wall_s,
        "completion_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_s": _stats([t.ttft_s for t in ok if t.ttft_s is not None]),
        "tpot_s": _stats([t.tpot_s for t in ok if t.tpot_s is not None]),
        "e2e_s": _stats([t.e2e_s for t in ok]),
    }


def plot(timings: list[RequestTiming], path: pathlib.Path) -> None:
    """PNG with the TTFT and TPOT histograms (milliseconds). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("TTFT", [t.ttft_s * 1e3 for t in timings if t.ttft_s is not None]),
              ("TPOT", [t.tpot_s * 1e3 for t in timings if t.tpot_s is not None])]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, values) in zip(axes, series):
        if values:
            ax.hist(values, bins=min(30, max(5, len(values))), color="tab:blue", alpha=0.8)
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(_percentile(values, q), color="black", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_title(f"{name} ({len(values)} requests)")
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def write_outputs(timings: list[RequestTiming], summary: dict[str, Any], config: dict[str, Any],
                  out_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``bench_report.json`` and ``bench_latency.png`` into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report, png = out_dir / "bench_report.json", out_dir / "bench_latency.png"
    report.write_text(json.dumps({"config": config, "summary": summary,
                                  "requests": [asdict(t) for t in timings]}, indent=2) + "\n")
    plot(timings, png)
    return report, png


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable lines of a summary (milliseconds)."""
    lines = [f"requests {summary['requests']} ok {summary['ok']} errors {summary['errors']} "
             f"wall {summary['wall_s']:.2f}s output {summary['output_tokens_per_s']:.1f} tok/s"]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        s = summary[key]
        if s is not None:
            lines.append(f"{key[:-2]:>5} ms  mean {s['mean'] * 1e3:8.1f}  p50 {s['p50'] * 1e3:8.1f}  "
                         f"p90 {s['p90'] * 1e3:8.1f}  p99 {s['p99'] * 1e3:8.1f}  max {s['max'] * 1e3:8.1f}")
    return "\n".join(lines)
