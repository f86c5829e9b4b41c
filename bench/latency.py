"""Single-stream latency: TTFT and TPOT of one request at a time, pagedserve over gRPC against HF `generate`.

    .venv/bin/python bench/latency.py [--max-new-tokens 128] [--repeats 3]

Same prompt (one chat prompt, rendered with the chat template) for both, greedy, exactly --max-new-tokens new
tokens (ours: ignore_eos; HF: min_new_tokens = max_new_tokens). Ours runs first, the server is stopped, then HF
runs; both with the same torch intra-op threads. HF token times come from a streamer (one put() per new token).
Prints the median over --repeats runs of each system and the ratio ours/HF of TPOT (lower is better).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default=common.QUICK_PROMPTS[0], help="user message of the chat prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", choices=["none", "auto", "int8", "int4"], default="none",
                   help="the server's --quantization (default none: both systems run the dequantized weights; "
                        "bench/quant.py compares the quantized server)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights / activations dtype of both systems (the server gets --dtype)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads for both")
    p.add_argument("--server-arg", action="append", default=[], help="extra `pagedserve serve` flag (repeatable)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def ours_once(client, request: common.BenchRequest) -> tuple[common.StreamRecord, list[int]]:
    """One Generate stream; returns its timings and its token ids."""
    token_ids: list[int] = []
    start = time.perf_counter()
    first = None
    for response in client.generate(prompt_token_ids=list(request.prompt_token_ids),
                                    max_tokens=request.max_new_tokens, temperature=0.0, ignore_eos=True):
        if response.token_ids:
            token_ids.extend(response.token_ids)
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    if len(token_ids) != request.max_new_tokens:
        raise RuntimeError(f"asked {request.max_new_tokens} tokens, got {len(token_ids)}")
    return common.StreamRecord(len(token_ids), first - start, end - start), token_ids


def bench_ours(args, request, warmup) -> tuple[list[common.StreamRecord], list[int]]:
    from pagedserve_client import PagedServeClient

    with common.ServerProcess(args.threads, ["--dtype", args.dtype, "--quantization", args.quantization, *args.server_arg]) as server:
        with PagedServeClient(server.target, timeout_s=600) as client:
            ours_once(client, warmup)
            runs = [ours_once(client, request) for _ in range(args.repeats)]
    return [r for r, _ in runs], runs[0][1]


def bench_hf(args, request, warmup, pad_id: int) -> tuple[list[common.StreamRecord], list[int]]:
    model = common.load_hf_model(args.dtype)
    common.hf_generate(model, [warmup], pad_id, warmup.max_new_tokens)
    records, token_ids = [], []
    for _ in range(args.repeats):
        streamer = common.TimingStreamer()
        out = common.hf_generate(model, [request], pad_id, request.max_new_tokens, streamer=streamer)
        records.append(streamer.record())
        token_ids = out[0].tolist()
    return records, token_ids


def summary(records: list[common.StreamRecord]) -> dict:
    return {"ttft_ms": statistics.median(r.ttft_s for r in records) * 1e3,
            "tpot_ms": statistics.median(r.tpot_s for r in records) * 1e3,
            "e2e_s": statistics.median(r.e2e_s for r in records),
            "runs": [{"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s} for r in records]}


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = common.configure_threads(args.threads)
    tokenizer = common.load_tokenizer()
    request = common.BenchRequest(common.chat_prompt_ids(tokenizer, args.prompt), args.max_new_tokens)
    warmup = common.warmup_request(tokenizer)
    results, tokens = {}, {}
    if not args.skip_ours:
        records, tokens["ours"] = bench_ours(args, request, warmup)
        results["ours"] = summary(records)
    if not args.skip_hf:
        records, tokens["hf"] = bench_hf(args, request, warmup, common.pad_id_of(tokenizer))
        results["hf"] = summary(records)
    print(f"\nprompt {len(request.prompt_token_ids)} tokens, {args.max_new_tokens} new tokens, greedy, "
          f"median of {args.repeats} runs")
    print(f"dtype: {args.dtype} (both systems); threads: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"{'system':<6} {'TTFT ms':>9} {'TPOT ms':>9} {'e2e s':>8}")
    for name, r in results.items():
        print(f"{name:<6} {r['ttft_ms']:>9.1f} {r['tpot_ms']:>9.2f} {r['e2e_s']:>8.2f}")
    report = {"dtype": args.dtype, "threads": settings, "prompt_tokens": len(request.prompt_token_ids), "results": results}
    if len(results) == 2:
        report["tpot_ratio_ours_over_hf"] = results["ours"]["tpot_ms"] / results["hf"]["tpot_ms"]
        report["same_tokens_prefix"] = common_prefix_len(tokens["ours"], tokens["hf"])
        print(f"TPOT ratio ours/HF: {report['tpot_ratio_ours_over_hf']:.2f} (goal <= 0.5); greedy outputs agree "
              f"on the first {report['same_tokens_prefix']} of {args.max_new_tokens} tokens")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
