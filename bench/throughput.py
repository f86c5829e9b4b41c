"""Output-token throughput: pagedserve over gRPC against HF transformers `generate`, in one run.

    .venv/bin/python bench/throughput.py --workload quick      # issue 2: 16 chat prompts x 64 new tokens
    .venv/bin/python bench/throughput.py --workload mixed      # issue 7: 64 requests, prompts 50..800, outputs 16..256
    .venv/bin/python bench/throughput.py --api both --skip-hf  # gRPC vs the OpenAI HTTP API, same server and run

Systems, measured one after the other (never at the same time), all greedy with EOS ignored:
  ours        `pagedserve serve` subprocess, every request its own Generate stream, `--concurrency` in flight
              (default: all); TTFT and TPOT per stream. `--api openai`: the same requests as streamed
              /v1/completions calls through the `openai` SDK's async client (prompt token ids, usage from
              stream_options.include_usage); `--api both`: gRPC then HTTP, `--rounds` times, on one server
              (systems ours-grpc and ours-http; each figure is from its fastest round).
  hf-batched  HF `generate` on left-padded static batches of `--hf-batch-size` requests in workload order; a batch
              runs to its longest output (min_new_tokens = max_new_tokens), only the tokens each request asked
              for are counted, the rest is reported as wasted.
  hf-single   HF `generate` one request at a time on the first `--hf-single-subset` requests.
Every system uses the same number of torch intra-op threads (`--threads`, default: all CPUs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["quick", "mixed"], default="quick")
    p.add_argument("--api", choices=["grpc", "openai", "both"], default="grpc",
                   help="how our server is called: gRPC Generate, the OpenAI HTTP API, or both (same server)")
    p.add_argument("--rounds", type=int, default=3, help="with --api both: alternating rounds per API")
    p.add_argument("--num-requests", type=int, default=None, help="default: 16 (quick) or 64 (mixed)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="quick workload's output length")
    p.add_argument("--seed", type=int, default=0, help="mixed workload's seed")
    p.add_argument("--concurrency", type=int, default=None, help="streams in flight (default: all requests)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-single-subset", type=int, default=4, help="requests HF runs one at a time (0: skip)")
    p.add_argument("--skip-hf", action="store_true", help="measure only our server")
    p.add_argument("--skip-ours", action="store_true", help="measure only HF transformers")
    p.add_argument("--quantization", choices=["none", "auto", "int8", "int4"], default="none",
                   help="the server's --quantization (default none: both systems run the dequantized weights; "
                        "bench/quant.py compares the quantized server)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights / activations dtype of both systems (the server gets --dtype)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads for every system")
    p.add_argument("--max-num-seqs", type=int, default=None, help="passed to the server")
    p.add_argument("--server-arg", action="append", default=[], help="extra `pagedserve serve` flag (repeatable)")
    p.add_argument("--json-out", default=None, help="write every figure and per-request record here")
    return p.parse_args(argv)


def build_workload(args, tokenizer) -> list[common.BenchRequest]:
    if args.workload == "quick":
        return common.quick_workload(tokenizer, args.num_requests or 16, args.max_new_tokens)
    return common.mixed_workload(tokenizer, args.num_requests or 64, seed=args.seed)


def bench_ours(args, requests, tokenizer) -> dict:
    extra = ["--dtype", args.dtype, "--quantization", args.quantization, *args.server_arg]
    if args.max_num_seqs is not None:
        extra += ["--max-num-seqs", str(args.max_num_seqs)]
    concurrency = args.concurrency or len(requests)
    t0 = time.perf_counter()
    apis = ["grpc", "openai"] if args.api == "both" else [args.api]
    runs: dict[str, list] = {api: [] for api in apis}
    with common.ServerProcess(args.threads, extra) as server:
        startup_s = time.perf_counter() - t0
        clients = {"grpc": lambda reqs, c: common.run_streams(server.target, reqs, c),
                   "openai": lambda reqs, c: common.run_http_streams(server.http_base_url, reqs, c)}
        for api in apis:
            asyncio.run(clients[api]([common.warmup_request(tokenizer)], 1))
        for _ in range(args.rounds if len(apis) > 1 else 1):  # alternate: drift on a noisy machine hits both
            for api in apis:
                runs[api].append(asyncio.run(clients[api](requests, concurrency)))
    results = []
    for api in apis:
        records, wall_s = min(runs[api], key=lambda run: run[1])
        tokens = sum(r.num_tokens for r in records)
        name = "ours" if len(apis) == 1 else {"grpc": "ours-grpc", "openai": "ours-http"}[api]
        results.append({"system": name, "api": api, "concurrency": concurrency, "server_argv": server.argv[1:],
                        "server_startup_s": startup_s, "num_requests": len(records), "output_tokens": tokens,
                        "wall_s": wall_s, "tokens_per_s": tokens / wall_s, **common.latency_summary(records),
                        "records": common.record_dicts(records)})
    return results


def bench_hf_batched(model, requests, pad_id: int, batch_size: int) -> dict:
    useful = generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        max_new = max(r.max_new_tokens for r in batch)
        out = common.hf_generate(model, batch, pad_id, max_new)
        assert out.shape == (len(batch), max_new), out.shape
        useful += sum(r.max_new_tokens for r in batch)
        generated += out.numel()
    wall_s = time.perf_counter() - start
    return {"system": "hf-batched", "batch_size": batch_size, "num_requests": len(requests),
            "output_tokens": useful, "wasted_tokens": generated - useful, "wall_s": wall_s,
            "tokens_per_s": useful / wall_s}


def bench_hf_single(model, requests, pad_id: int) -> dict:
    records = []
    start = time.perf_counter()
    for r in requests:
        streamer = common.TimingStreamer()
        common.hf_generate(model, [r], pad_id, r.max_new_tokens, streamer=streamer)
        records.append(streamer.record())
    wall_s = time.perf_counter() - start
    tokens = sum(r.num_tokens for r in records)
    return {"system": "hf-single", "num_requests": len(requests), "output_tokens": tokens, "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s, **common.latency_summary(records),
            "records": common.record_dicts(records)}


def bench_hf(args, requests, tokenizer) -> list[dict]:
    t0 = time.perf_counter()
    model = common.load_hf_model(args.dtype)
    load_s = time.perf_counter() - t0
    pad_id = common.pad_id_of(tokenizer)
    common.hf_generate(model, [common.warmup_request(tokenizer)], pad_id, 8)
    results = [bench_hf_batched(model, requests, pad_id, args.hf_batch_size)]
    if args.hf_single_subset > 0:
        results.append(bench_hf_single(model, requests[:args.hf_single_subset], pad_id))
    for r in results:
        r["model_load_s"] = load_s
    return results


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(args, requests, settings: dict, results: list[dict]) -> dict:
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    print(f"\nworkload {args.workload}: {len(requests)} requests, prompt tokens {min(prompt_lens)}..{max(prompt_lens)}"
          f" (total {sum(prompt_lens)}), output tokens total {sum(r.max_new_tokens for r in requests)}")
    print(f"dtype: {args.dtype} (both systems); threads: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    head = f"{'system':<11} {'reqs':>4} {'out tok':>7} {'wall s':>8} {'tok/s':>8} " \
           f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}  (ms)"
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['system']:<11} {r['num_requests']:>4} {r['output_tokens']:>7} {r['wall_s']:>8.2f} "
              f"{r['tokens_per_s']:>8.1f} {_fmt(r.get('ttft_ms_p50'), '9.1f'):>9} "
              f"{_fmt(r.get('ttft_ms_p99'), '9.1f'):>9} {_fmt(r.get('tpot_ms_p50'), '9.1f'):>9} "
              f"{_fmt(r.get('tpot_ms_p99'), '9.1f'):>9}")
    by_name = {r["system"]: r for r in results}
    ratios = {}
    for ours in ("ours", "ours-grpc", "ours-http"):
        for other in ("hf-batched", "hf-single"):
            if ours in by_name and other in by_name:
                ratios[f"{ours}/{other}"] = by_name[ours]["tokens_per_s"] / by_name[other]["tokens_per_s"]
    if "ours-grpc" in by_name and "ours-http" in by_name:
        grpc_r, http_r = by_name["ours-grpc"], by_name["ours-http"]
        ratios["ours-http/ours-grpc"] = http_r["tokens_per_s"] / grpc_r["tokens_per_s"]
        ratios["TTFT p50 http/grpc"] = http_r["ttft_ms_p50"] / grpc_r["ttft_ms_p50"]
    for name, value in ratios.items():
        print(f"ratio {name if name.startswith('TTFT') else 'tokens/s ' + name}: {value:.2f}x")
    if "hf-batched" in by_name and by_name["hf-batched"]["wasted_tokens"]:
        print(f"hf-batched also generated {by_name['hf-batched']['wasted_tokens']} padding-run tokens "
              "(rows past their own length), not counted")
    return ratios


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.skip_hf and args.skip_ours:
        print("nothing to measure: --skip-hf and --skip-ours", file=sys.stderr)
        return 2
    settings = common.configure_threads(args.threads)
    tokenizer = common.load_tokenizer()
    requests = build_workload(args, tokenizer)
    results = []
    if not args.skip_ours:
        results.extend(bench_ours(args, requests, tokenizer))  # server stopped before HF starts
    if not args.skip_hf:
        results.extend(bench_hf(args, requests, tokenizer))
    ratios = print_report(args, requests, settings, results)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"workload": args.workload, "args": vars(args), "threads": settings, "ratios": ratios,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
