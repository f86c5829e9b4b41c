"""The table of bench/serve_compare.py: one row per (workload, concurrency, system), read from the result JSON that
vLLM's `vllm bench serve --save-result` writes for each run, rendered as markdown and as JSON.

Metric definitions are vLLM's (vllm/benchmarks/serve.py), all from the client side:
- output tok/s: output tokens of the completed requests / the run's duration (first request sent to last one done);
- total tok/s: (input + output tokens) / duration;
- TTFT: request sent to the first streamed chunk with text, in ms (median = p50, and p99);
- TPOT: (e2e latency - TTFT) / (output tokens - 1) per request, in ms (median = p50, and p99).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass

#: result-JSON keys read for each run: (row field, vLLM key)
VLLM_KEYS = (("output_tok_s", "output_throughput"), ("total_tok_s", "total_token_throughput"),
             ("ttft_p50_ms", "median_ttft_ms"), ("ttft_p99_ms", "p99_ttft_ms"),
             ("tpot_p50_ms", "median_tpot_ms"), ("tpot_p99_ms", "p99_tpot_ms"),
             ("duration_s", "duration"))


@dataclass
class Row:
    """One benchmark run: a system under one workload at one concurrency (None metrics: the run failed)."""

    workload: str            # e.g. "random-256", "prefix-512+64"
    concurrency: int         # vLLM's --max-concurrency
    system: str              # pagedserve | llamacpp | vllm
    num_prompts: int
    completed: int = 0
    output_tokens: int = 0   # total over completed requests (expected num_prompts * output_len)
    output_tok_s: float | None = None
    total_tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    duration_s: float | None = None
    error: str = ""          # why there is no measurement ("server not ready", the bench's last log line, ...)


def row_from_result(result: dict, workload: str, concurrency: int, system: str, num_prompts: int) -> Row:
    """A Row from the dict of one `vllm bench serve` result JSON.

    Raises ValueError naming the first missing key (a vLLM version whose result format differs).
    """
    row = Row(workload, concurrency, system, num_prompts)
    for key in ("completed", "total_output_tokens", *(k for _, k in VLLM_KEYS)):
        if key not in result:
            raise ValueError(f"vllm bench serve result has no {key!r} (keys: {sorted(result)[:20]}...)")
    row.completed = int(result["completed"])
    row.output_tokens = int(result["total_output_tokens"])
    for field, key in VLLM_KEYS:
        setattr(row, field, float(result[key]))
    return row


def failed_row(workload: str, concurrency: int, system: str, num_prompts: int, error: str) -> Row:
    """A Row without measurements; error says why (kept to one line)."""
    return Row(workload, concurrency, system, num_prompts, error=" ".join(error.split())[:200])


def machine_header(repo_dir: str) -> dict:
    """What the figures depend on: the `lscpu` model line, CPU count, the repo's commit (with a -dirty mark when
    the working tree has changes), the OS and the 1-minute load average just before the run."""
    def run(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, cwd=repo_dir, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    model = next((line.split(":", 1)[1].strip() for line in run(["lscpu"]).splitlines()
                  if line.startswith("Model name:")), platform.processor() or "unknown")
    commit = run(["git", "rev-parse", "--short=12", "HEAD"]) or "unknown"
    if run(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += "-dirty"
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "git_commit": commit,
            "platform": platform.platform(), "loadavg_1m_before": round(os.getloadavg()[0], 2)}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(header: dict, rows: list[Row]) -> str:
    """The whole report: a header block, then ONE table (rows in run order), then the failed runs' reasons."""
    lines = ["# Served speed: pagedserve vs llama.cpp's llama-server vs vLLM CPU", "",
             f"- CPU (`lscpu` model name): {header.get('cpu_model')}, {header.get('cpu_count')} CPUs",
             f"- pagedserve commit: {header.get('git_commit')}",
             f"- date (UTC): {header.get('date_utc')}; 1-minute load average before: "
             f"{header.get('loadavg_1m_before')}",
             f"- client: `vllm bench serve` ({header.get('client')}), streamed `/v1/completions`, random token "
             f"prompts, {header.get('output_len')} output tokens with `ignore_eos`, temperature 0, one server "
             "at a time",
             f"- systems: {header.get('systems_desc')}", ""]
    lines += ["| workload | conc | system | done | out tok/s | total tok/s | TTFT p50 ms | TTFT p99 ms "
              "| TPOT p50 ms | TPOT p99 ms |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        done = f"{r.completed}/{r.num_prompts}" if not r.error else "failed"
        lines.append(f"| {r.workload} | {r.concurrency} | {r.system} | {done} | {_fmt(r.output_tok_s)} | "
                     f"{_fmt(r.total_tok_s)} | {_fmt(r.ttft_p50_ms, 0)} | {_fmt(r.ttft_p99_ms, 0)} | "
                     f"{_fmt(r.tpot_p50_ms)} | {_fmt(r.tpot_p99_ms)} |")
    notes = [r for r in rows if r.error]
    if notes:
        lines += ["", "Failed runs:"] + [f"- {r.workload} c={r.concurrency} {r.system}: {r.error}" for r in notes]
    short = [r for r in rows if not r.error and r.output_tokens != r.completed * header.get("output_len", 0)]
    if short:
        lines += ["", "Runs whose output token count is not completed x output_len (a server ignored ignore_eos "
                  "or max_tokens):"] + [f"- {r.workload} c={r.concurrency} {r.system}: {r.output_tokens}"
                                        for r in short]
    return "\n".join(lines) + "\n"


def write_report(path_prefix: str, header: dict, rows: list[Row]) -> tuple[str, str]:
    """Write <path_prefix>.md and <path_prefix>.json (header + rows); return both paths."""
    md_path, json_path = path_prefix + ".md", path_prefix + ".json"
    with open(md_path, "w") as f:
        f.write(markdown(header, rows))
    with open(json_path, "w") as f:
        json.dump({"header": header, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return md_path, json_path
