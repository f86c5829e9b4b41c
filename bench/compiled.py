"""Compiled forward against eager (issue 17): decode-step time at 1 and 32 running requests, 1 and 2 threads.

    .venv/bin/python bench/compiled.py                          # threads 1 and 2, running 1 and 32, 10 steps
    .venv/bin/python bench/compiled.py --profile                # plus the top ops of one decode step per mode
    TORCHINDUCTOR_CACHE_DIR=/tmp/fresh .venv/bin/python bench/compiled.py   # a cold start (empty inductor cache)

The embedded model (CPU, ``--attention-backend`` (default auto: the C++ cpu backend), ``--quantization``, fp32
activations) in-process. One child process per
thread count (inductor bakes the OpenMP thread count into its kernels, and torch reads OMP_NUM_THREADS at start):
it builds an eager engine (``enforce_eager=True``) and a compiled one (``enforce_eager=False``, compiled for the
``--running`` sizes only) over the same loaded weights, adds N requests of ``--prompt-tokens`` random tokens to
each, runs until every prompt is computed, then times ``--steps`` decode steps, eager and compiled steps
alternating (so a change in the machine's load hits both alike). Prints ms per decode step for each, the ratio,
the compile time of the compiled engine ("cold" when inductor's cache missed, "warm" when it held every graph) and
with ``--profile`` the torch profiler's top ops of one step per mode.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op thread counts")
    p.add_argument("--running", type=int, nargs="+", default=[1, 32], help="requests decoding together")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per mode and N")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default="none")
    p.add_argument("--attention-backend", choices=["auto", "cpu", "torch"], default="auto")
    p.add_argument("--profile", action="store_true", help="print the top ops of one decode step per mode and N")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def start_decoding(engine, running: int, args) -> None:
    """Add ``running`` requests of random prompts and step until every prompt is computed."""
    from pagedserve.sampling_params import SamplingParams

    rng = random.Random(running)
    params = SamplingParams(max_tokens=args.steps + 4, ignore_eos=True, temperature=0.0)
    for i in range(running):
        engine.add_request(f"r{running}-{i}", [rng.randrange(100, engine.vocab_size - 100)
                                               for _ in range(args.prompt_tokens)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.num_waiting:
        engine.step()
    engine.step()  # one untimed decode step


def decode_steps_ms(engines: dict, running: int, args) -> tuple[dict[str, float], dict[str, str | None]]:
    """Mean ms of a decode step with ``running`` requests for each engine, their steps alternating (so a change
    in what else runs on the machine hits both alike); with ``args.profile`` the top ops of one more step each."""
    import torch

    for engine in engines.values():
        start_decoding(engine, running, args)
    totals = dict.fromkeys(engines, 0.0)
    for _ in range(args.steps - 1):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            totals[name] += time.perf_counter() - start
    tables = dict.fromkeys(engines)
    for name, engine in engines.items():
        if args.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
            tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        assert len(engine.scheduler.running) == running, "requests finished early"
        while engine.has_unfinished():
            engine.step()
    return {name: t / (args.steps - 1) * 1e3 for name, t in totals.items()}, tables


def child(args) -> dict:
    import common

    settings = common.configure_threads(args.threads[0])
    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    source = ModelSource.resolve(None)
    cfg, tokenizer = source.load_config(), source.load_tokenizer()
    model = build_model(source, cfg, torch.float32, "cpu", args.quantization)
    base = dict(device="cpu", dtype="float32", attention_backend=args.attention_backend, max_num_seqs=max(args.running),
                max_model_len=args.prompt_tokens + args.steps + 16, quantization=args.quantization,
                num_kv_blocks=max(args.running) * ((args.prompt_tokens + args.steps + 16) // 16 + 2))
    eager, _ = build_engine(EngineConfig(**base, enforce_eager=True), model=model, tokenizer=tokenizer,
                            hf_config=cfg)
    compiled, info = build_engine(EngineConfig(**base, enforce_eager=False), model=model, tokenizer=tokenizer,
                                  hf_config=cfg, compile_sizes=args.running)
    rows = []
    for running in args.running:
        ms, tables = decode_steps_ms({"eager": eager, "compiled": compiled}, running, args)
        rows.append(dict(running=running, eager_ms=ms["eager"], compiled_ms=ms["compiled"],
                         eager_profile=tables["eager"], compiled_profile=tables["compiled"]))
    return dict(threads=args.threads[0], settings=settings, compile_s=info.compile_s,
                compile_cache=info.compile_cache, rows=rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"decode steps, {args.prompt_tokens}-token prompts, quantization {args.quantization}, "
          f"attention backend {args.attention_backend}, "
          f"{args.steps} steps each; inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')}")
    print("threads  running  eager ms/step  compiled ms/step  speed-up  (compile s)")
    for threads in args.threads:
        cmd = [sys.executable, os.path.join(here, "compiled.py"), "--child", "--threads", str(threads),
               "--running", *map(str, args.running), "--prompt-tokens", str(args.prompt_tokens),
               "--steps", str(args.steps), "--quantization", args.quantization,
               "--attention-backend", args.attention_backend]
        cmd += ["--profile"] if args.profile else []
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        out = proc.stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        for row in result["rows"]:
            print(f"{threads:7d}  {row['running']:7d}  {row['eager_ms']:13.1f}  {row['compiled_ms']:16.1f}  "
                  f"{row['eager_ms'] / row['compiled_ms']:7.2f}x  ({result['compile_s']:.1f} "
                  f"{result['compile_cache']})")
            if args.profile:
                print(f"--- eager, {row['running']} running, {threads} threads\n{row['eager_profile']}")
                print(f"--- compiled, {row['running']} running, {threads} threads\n{row['compiled_profile']}")
        print(f"  settings: {result['settings']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
