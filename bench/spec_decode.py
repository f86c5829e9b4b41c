"""Speculative decoding (n-gram drafts): the same server with and without `--speculative-config`, side by side.

    .venv/bin/python bench/spec_decode.py [--repeats 2] [--mixed-requests 32] [--streams 16]

Both servers start at once (an idle server costs no CPU) and are driven alternately, plain then speculative, so
drift on a shared machine hits both alike; each figure is the best of --repeats runs.

- quoting, one stream: chat prompts whose answer quotes or rewrites their text (repeat a paragraph, fix its
  spelling, put it in the past tense), greedy, up to --quote-tokens new tokens, EOS honoured. Both servers must
  produce the same tokens (greedy output is unchanged by speculation); prints TPOT per prompt and the ratio
  speculative / plain (target <= 0.5).
- mixed, --streams concurrent streams: bench/throughput.py's mixed workload (random-token prompts of 50..800
  tokens, 16..256 output tokens, EOS ignored), output tokens/s and the ratio (target >= 0.95).
Prints `uptime` before and after (the machine's load average beside the figures).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import common

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
PARAGRAPH = ("Paged attention stores the key and value cache in fixed-size blocks, so memory is allocated on "
             "demand and shared between requests with a common prefix. A block table maps each sequence's logical "
             "blocks to physical ones, and the scheduler frees the blocks of finished requests at once. Continuous "
             "batching adds new requests to the running batch at every step, so a short request never waits for "
             "a long one to finish.")
TYPOS = PARAGRAPH.replace("memory", "memroy").replace("scheduler", "schedular").replace("waits", "wiats")
QUOTING_PROMPTS = (
    f"Repeat the following text exactly, without changing a word:\n\n{PARAGRAPH}",
    f"Fix the spelling mistakes in this text and return the corrected text: {TYPOS}",
    f"Rewrite this text in the past tense:\n\n{PARAGRAPH}",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="alternated runs per system; the best counts")
    p.add_argument("--quote-tokens", type=int, default=160)
    p.add_argument("--mixed-requests", type=int, default=32)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--spec", default=json.dumps(SPEC), help="--speculative-config of the speculative server")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--skip-mixed", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def quote_once(target: str, ids: tuple[int, ...], max_tokens: int) -> tuple[list[int], float, float]:
    """One greedy stream; returns (tokens, ttft_s, tpot_s)."""
    from pagedserve_client import PagedServeClient

    tokens, first = [], None
    with PagedServeClient(target, timeout_s=600) as client:
        start = time.perf_counter()
        for response in client.generate(prompt_token_ids=list(ids), max_tokens=max_tokens, temperature=0.0):
            if response.token_ids:
                tokens.extend(response.token_ids)
                first = first or time.perf_counter()
        end = time.perf_counter()
    return tokens, first - start, (end - first) / max(1, len(tokens) - 1)


def bench_quoting(args, servers, tokenizer) -> list[dict]:
    rows = []
    for text in QUOTING_PROMPTS:
        ids = common.chat_prompt_ids(tokenizer, text)
        best: dict[str, float] = {}
        outputs: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for name, server in servers.items():
                tokens, _, tpot = quote_once(server.target, ids, args.quote_tokens)
                if outputs.setdefault(name, tokens) != tokens:
                    raise RuntimeError(f"{name}: greedy output changed between runs")
                best[name] = min(best.get(name, float("inf")), tpot)
        if outputs["plain"] != outputs["spec"]:
            raise RuntimeError(f"speculation changed the greedy output of {text[:40]!r}")
        rows.append({"prompt": text[:48], "tokens": len(outputs["plain"]), "tpot_plain_ms": 1e3 * best["plain"],
                     "tpot_spec_ms": 1e3 * best["spec"], "ratio": best["spec"] / best["plain"]})
        r = rows[-1]
        print(f"  {r['prompt']!r:52} {r['tokens']:4d} tokens  TPOT plain {r['tpot_plain_ms']:7.1f} ms"
              f"  spec {r['tpot_spec_ms']:7.1f} ms  ratio {r['ratio']:.2f}", flush=True)
    return rows


def bench_mixed(args, servers, tokenizer) -> dict:
    requests = common.mixed_workload(tokenizer, args.mixed_requests, seed=0)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, server in servers.items():
            records, wall_s = asyncio.run(common.run_streams(server.target, requests, args.streams))
            tps = sum(r.num_tokens for r in records) / wall_s
            best[name] = max(best.get(name, 0.0), tps)
            print(f"  mixed {name:5}: {tps:6.1f} tok/s ({wall_s:.1f} s)", flush=True)
    return {"requests": len(requests), "streams": args.streams, "tok_s_plain": best["plain"],
            "tok_s_spec": best["spec"], "ratio": best["spec"] / best["plain"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = common.load_tokenizer()
    print(f"uptime before: {uptime()}", flush=True)
    plain = common.ServerProcess(args.threads)
    spec = common.ServerProcess(args.threads, ["--speculative-config", args.spec])
    with plain, spec:
        servers = {"plain": plain, "spec": spec}
        for server in servers.values():  # warm-up
            asyncio.run(common.run_streams(server.target, [common.warmup_request(tokenizer)], 1))
        print(f"quoting, one stream (speculative config {args.spec}):", flush=True)
        quoting = bench_quoting(args, servers, tokenizer)
        mixed = None if args.skip_mixed else bench_mixed(args, servers, tokenizer)
    ratio = statistics.mean(r["ratio"] for r in quoting)
    print(f"\nratio TPOT spec/plain, quoting one stream (mean over prompts): {ratio:.2f}  (target <= 0.5)")
    if mixed:
        print(f"ratio tok/s spec/plain, mixed {mixed['streams']} streams: {mixed['ratio']:.3f}  (target >= 0.95)")
    print(f"uptime after: {uptime()}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "quoting": quoting, "quoting_ratio": ratio, "mixed": mixed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
