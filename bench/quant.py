"""Quantized weights (issue 18): pagedserve with --quantization against HF `generate` fp32 and llama.cpp, one run.

    .venv/bin/python bench/quant.py [--quantization auto] [--llamacpp-python .venv-llamacpp/bin/python]

On the embedded SmolLM2-135M-Instruct Q4_1 GGUF, greedy, EOS ignored, every system with --threads intra-op threads
in its own process; ours and llama.cpp are loaded together and take turns (never run at once), HF runs after both
are stopped:
- `ours`: `pagedserve serve --quantization Q --dtype float32`: one stream (--max-new-tokens, median of --repeats
  runs; TTFT, TPOT), then --streams concurrent chat streams of --stream-tokens each (output tokens/s, prefill
  included).
- `llama.cpp`: llama-cpp-python on the same GGUF file, one stream (`Llama.generate`, top-k 1; median of --repeats
  runs), run by --llamacpp-python (a separate venv: `make bench-llamacpp-setup`) in a worker process that stays
  loaded; skipped, with a message, when that interpreter cannot import llama_cpp. Its tokens/s is 1 / TPOT
  (decode only, no prefill).
- The 16-stream ratio is taken in --rounds rounds while both stay loaded and idle between turns: each round runs our
  streams (a new cache salt per round, so no prefix-cache hits on an earlier round) and one llama.cpp stream, in
  alternating order; the ratio is the median of the rounds' ratios (the machines drift by up to 1.3x in minutes,
  so each round compares two measurements taken seconds apart).
- `hf`: HF transformers `generate` in float32 on the same GGUF (dequantized), one stream, a streamer's timings.
- weight memory: RSS grown by `build_model` in a fresh process, --quantization none against Q.

Prints the table and the issue's ratios: our TPOT / HF's (goal <= 0.35), our streams' tokens/s / llama.cpp's
single-stream tokens/s (goal >= 2), llama.cpp's TPOT beside ours, RSS ratio (goal <= 0.40).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys

import common
import latency

# A worker: loads the model once, then for each line "N" on stdin generates N tokens greedily from the prompt and
# prints one JSON line (ttft_s, tpot_s, e2e_s, token_ids); the first line out is {"ready": version}.
LLAMACPP_WORKER = r"""
import json, sys, time
import llama_cpp
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
prompt = json.loads(sys.argv[3])
llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
def once(ids, n):
    start = time.perf_counter(); times = []; out = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter()); out.append(int(tok))
        if len(out) == n:
            break
    return {"ttft_s": times[0] - start, "e2e_s": times[-1] - start, "tpot_s": (times[-1] - times[0]) / (n - 1),
            "token_ids": out}
once(prompt[:8], 8)
print(json.dumps({"ready": llama_cpp.__version__}), flush=True)
for line in sys.stdin:
    print(json.dumps(once(prompt, int(line))), flush=True)
"""


class LlamaCppWorker:
    """LLAMACPP_WORKER as a subprocess; ``run(n)`` returns one generation's timings."""

    def __init__(self, python: str, path: str, threads: int, prompt_ids: tuple[int, ...]):
        self.proc = subprocess.Popen([python, "-c", LLAMACPP_WORKER, path, str(threads), json.dumps(list(prompt_ids))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=common.server_env(threads))
        self.version = self._read()["ready"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, n: int) -> dict:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


RSS_SCRIPT = r"""
import json, sys, torch
from pagedserve.models.loader import ModelSource
from pagedserve.models.registry import build_model
import gguf, transformers, tqdm.auto
src = ModelSource.resolve(None); cfg = src.load_config()
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
model = build_model(src, cfg, torch.float32, "cpu", quantization=sys.argv[1])
print(json.dumps({"rss_bytes": rss() - before, "quantization": model.quantization}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="auto", choices=["auto", "int4", "int8", "none"])
    p.add_argument("--prompt", default=common.QUICK_PROMPTS[0], help="user message of the single-stream prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="our server's --kv-cache-dtype (auto: the model's float32)")
    p.add_argument("--rounds", type=int, default=5,
                   help="alternating rounds of our streams and one llama.cpp stream (the ratio is their median)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--llamacpp-python", default=os.environ.get("LLAMACPP_PYTHON", sys.executable),
                   help="Python interpreter that can import llama_cpp (default: $LLAMACPP_PYTHON, else this one)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def llamacpp_worker(args, request) -> LlamaCppWorker | None:
    check = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp"], capture_output=True, text=True)
    if check.returncode != 0:
        print(f"llama.cpp: skipped, {args.llamacpp_python} cannot import llama_cpp "
              f"(make bench-llamacpp-setup builds one; then --llamacpp-python .venv-llamacpp/bin/python)")
        return None
    path = os.path.join(*common.model_location())
    return LlamaCppWorker(args.llamacpp_python, path, args.threads, request.prompt_token_ids)


def bench_ours_and_llamacpp(args, request, warmup, tokenizer) -> tuple[dict, dict | None]:
    """Our server and the llama.cpp worker, both loaded: single streams of each, then the alternating rounds."""
    from pagedserve_client import PagedServeClient

    extra = ["--dtype", "float32", "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype]
    with common.ServerProcess(args.threads, extra) as server:
        with PagedServeClient(server.target, timeout_s=600) as client:
            quantization = client.model_info().generation.quantization
            latency.ours_once(client, warmup)
            runs = [latency.ours_once(client, request) for _ in range(args.repeats)]
        ours = latency.summary([r for r, _ in runs])
        ours.update(quantization=quantization, token_ids=runs[0][1], streams=args.streams, rounds=[])
        worker = llamacpp_worker(args, request)
        llama = None
        try:
            if worker is not None:
                single = [worker.run(args.max_new_tokens) for _ in range(args.repeats)]
                llama = {"version": worker.version, "ttft_ms": statistics.median(r["ttft_s"] for r in single) * 1e3,
                         "tpot_ms": statistics.median(r["tpot_s"] for r in single) * 1e3,
                         "e2e_s": statistics.median(r["e2e_s"] for r in single),
                         "token_ids": single[0]["token_ids"], "rounds": []}
            requests = common.quick_workload(tokenizer, args.streams, args.stream_tokens)
            for i in range(args.rounds):
                order = ("ours", "llama.cpp") if i % 2 == 0 else ("llama.cpp", "ours")
                for who in order:
                    if who == "ours":
                        records, wall_s = asyncio.run(common.run_streams(server.target, requests, args.streams,
                                                                         cache_salt=f"round-{i}"))
                        ours["rounds"].append({
                            "tokens_per_s": sum(r.num_tokens for r in records) / wall_s,
                            "tpot_p50_ms": common.percentile([r.tpot_s for r in records], 50) * 1e3,
                            "ttft_p50_ms": common.percentile([r.ttft_s for r in records], 50) * 1e3})
                    elif llama is not None:
                        llama["rounds"].append(worker.run(args.max_new_tokens)["tpot_s"] * 1e3)
        finally:
            if worker is not None:
                worker.close()
    ours["streams_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ours["rounds"])
    ours["streams_tpot_p50_ms"] = statistics.median(r["tpot_p50_ms"] for r in ours["rounds"])
    return ours, llama


def weight_rss(quantization: str) -> dict:
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, quantization], capture_output=True, text=True,
                         check=True, env=common.server_env(1))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = common.configure_threads(args.threads)
    tokenizer = common.load_tokenizer()
    request = common.BenchRequest(common.chat_prompt_ids(tokenizer, args.prompt), args.max_new_tokens)
    warmup = common.warmup_request(tokenizer)
    ours, llama = bench_ours_and_llamacpp(args, request, warmup, tokenizer)
    res = {"ours": ours, "llama.cpp": llama}
    if not args.skip_hf:
        records, hf_tokens = latency.bench_hf(argparse.Namespace(dtype="float32", repeats=args.repeats),
                                              request, warmup, common.pad_id_of(tokenizer))
        res["hf"] = {**latency.summary(records), "token_ids": hf_tokens}
    rss = {q: weight_rss(q) for q in ("none", args.quantization)}
    print(f"\nprompt {len(request.prompt_token_ids)} tokens, {args.max_new_tokens} new tokens, greedy, median of "
          f"{args.repeats}; threads: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"ours: --quantization {args.quantization} -> {res['ours']['quantization']}; "
          f"--kv-cache-dtype {args.kv_cache_dtype}")
    print(f"{'system':<10} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s 1 stream':>15}  greedy = ours on first")
    for name, r in res.items():
        if r is not None:
            same = latency.common_prefix_len(r["token_ids"], res["ours"]["token_ids"])
            print(f"{name:<10} {r['ttft_ms']:>9.1f} {r['tpot_ms']:>9.2f} {1e3 / r['tpot_ms']:>15.1f}  {same}")
    ours = res["ours"]
    print(f"ours, {args.streams} streams x {args.stream_tokens} tokens, median of {args.rounds} rounds: "
          f"{ours['streams_tokens_per_s']:.1f} tok/s, TPOT p50 {ours['streams_tpot_p50_ms']:.1f} ms")
    for i, r in enumerate(ours["rounds"]):
        line = f"  round {i}: ours {r['tokens_per_s']:.1f} tok/s (TPOT p50 {r['tpot_p50_ms']:.1f} ms, TTFT p50 " \
               f"{r['ttft_p50_ms']:.0f} ms)"
        if llama is not None:
            line += f", llama.cpp one stream {1e3 / llama['rounds'][i]:.1f} tok/s -> " \
                    f"{r['tokens_per_s'] * llama['rounds'][i] / 1e3:.2f}x"
        print(line)
    ratios = {}
    if "hf" in res:
        ratios["tpot_ours_over_hf_fp32"] = ours["tpot_ms"] / res["hf"]["tpot_ms"]
    if res["llama.cpp"] is not None:
        ratios["tpot_ours_over_llamacpp"] = ours["tpot_ms"] / res["llama.cpp"]["tpot_ms"]
        ratios["streams_tok_s_over_llamacpp_single"] = statistics.median(
            r["tokens_per_s"] * tpot_ms / 1e3 for r, tpot_ms in zip(ours["rounds"], llama["rounds"]))
    ratios["weight_rss_over_fp32"] = rss[args.quantization]["rss_bytes"] / rss["none"]["rss_bytes"]
    print(f"weight RSS: fp32 {rss['none']['rss_bytes'] / 2**20:.0f} MiB, {args.quantization} "
          f"{rss[args.quantization]['rss_bytes'] / 2**20:.0f} MiB")
    goals = {"tpot_ours_over_hf_fp32": "<= 0.35", "streams_tok_s_over_llamacpp_single": ">= 2",
             "weight_rss_over_fp32": "<= 0.40", "tpot_ours_over_llamacpp": "(reported)"}
    for k, v in ratios.items():
        print(f"{k}: {v:.3f} (goal {goals[k]})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"settings": settings, "results": res, "rss": rss, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
