"""pagedserve against an earlier checkout of itself, served, alternating (a restructuring must not cost speed).

Runs ``bench/serve_compare.py --systems pagedserve`` once per workload for each side, alternating
``before, after, before, after, ...`` so that both sides see the machine in the same state; the ``before`` side's
server imports the package from ``--before-src`` (its ``service/`` directory, put first on PYTHONPATH), the ``after``
side from this checkout. Prints one table: per (workload, concurrency) cell each side's output tok/s, TTFT p50 and
TPOT p50 and the ratio after / before (tok/s: > 1 is faster; latencies: < 1 is faster). ``--rounds N`` repeats the
alternation N times (before/after, after/before, ...) and reports each side's median per cell (a cell of one round
at one stream is 8 requests: a shared guest's noise can outweigh a 3% criterion there).

    git worktree add /tmp/before <commit>
    .venv/bin/python bench/serve_ab.py --before-src /tmp/before/service

Needs the vLLM venv of the anchors (``make bench-anchors-setup``; only its ``vllm bench serve`` client is used).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
METRICS = (("output_tok_s", "out tok/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("tpot_p50_ms", "TPOT p50 ms"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before-src", required=True, help="the earlier checkout's service/ directory")
    p.add_argument("--input-lens", default="256,1024", help="random workloads' prompt tokens, comma-separated")
    p.add_argument("--concurrency", default="1,4,16,32", help="passed to serve_compare.py")
    p.add_argument("--no-prefix", action="store_true", help="skip the shared-prefix workload")
    p.add_argument("--out-dir", default="", help="default: /tmp/serve_ab/<UTC time>")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternations per workload (before/after, then after/before, ...); cells report medians")
    p.add_argument("--compare-arg", action="append", default=[], help="extra serve_compare.py argument")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.before_src, "pagedserve")):
        p.error(f"--before-src: no pagedserve package under {args.before_src!r}")
    return args


def workload_args(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, serve_compare.py arguments) of each workload, run as its own invocation."""
    out = [(f"random-{n}", ["--input-lens", n.strip(), "--no-prefix"]) for n in args.input_lens.split(",") if n.strip()]
    if not args.no_prefix:
        out.append(("prefix", ["--no-random"]))
    return out


def run_side(side: str, extra: list[str], args: argparse.Namespace, out_dir: str) -> list[dict]:
    env = dict(os.environ)
    if side == "before":
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.before_src)] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, os.path.join(HERE, "serve_compare.py"), "--systems", "pagedserve", "--concurrency",
           args.concurrency, "--out-dir", out_dir, *extra, *args.compare_arg]
    print(f"[serve_ab] {side}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    with open(os.path.join(out_dir, "serve_compare.json")) as f:
        return json.load(f)["rows"]


def ratio(after, before) -> str:
    return f"{after / before:.3f}" if after is not None and before else "-"


def medians(rows: list[dict]) -> dict[tuple, dict]:
    """{(workload, concurrency): {metric: median over the rounds}} (a metric missing in a round is left out)."""
    cells: dict[tuple, dict[str, list]] = {}
    for r in rows:
        cell = cells.setdefault((r["workload"], r["concurrency"]), {})
        for k, _ in METRICS:
            if r.get(k) is not None:
                cell.setdefault(k, []).append(r[k])
    return {key: {k: round(statistics.median(v), 2) for k, v in cell.items()} for key, cell in cells.items()}


def table(rows: dict[str, list[dict]]) -> str:
    before, after = medians(rows["before"]), medians(rows["after"])
    lines = ["| workload | streams | " + " | ".join(f"{name} before / after (ratio)" for _, name in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for key, a in after.items():
        b = before.get(key, {})
        cells = [f"{b.get(k)} / {a.get(k)} ({ratio(a.get(k), b.get(k))})" for k, _ in METRICS]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out_dir or os.path.join("/tmp/serve_ab", datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    rows: dict[str, list[dict]] = {"before": [], "after": []}
    for rnd in range(args.rounds):
        for label, extra in workload_args(args):
            for side in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
                rows[side] += run_side(side, extra, args, os.path.join(out_dir, f"{label}-{side}-r{rnd}"))
    text = table(rows)
    with open(os.path.join(out_dir, "serve_ab.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "serve_ab.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print(text)
    print(f"[serve_ab] wrote {out_dir}/serve_ab.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
