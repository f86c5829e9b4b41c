"""Where a decode step's time goes at N running requests (issue 7): the engine in-process, each part timed.

    .venv/bin/python bench/profile_step.py                      # 32 running, 300-token prompts, 20 decode steps
    .venv/bin/python bench/profile_step.py --temperature 0      # greedy (no top-k / top-p work)
    .venv/bin/python bench/profile_step.py --running 16 --by-module --kv-cache-dtype float16   # each layer's share
    .venv/bin/py-spy record -o /tmp/step.svg -- .venv/bin/python bench/profile_step.py --steps 100   # flame graph

Builds the engine on the embedded model (CPU, torch attention), adds `--running` requests with random prompts of
`--prompt-tokens` tokens, runs until every prompt is computed, then times `--steps` decode steps. Each part is
timed by wrapping it: the model forward (all layers), the LM head (logits of the sampled rows), the sampler,
appending tokens / stop checks (`Scheduler.update_from_output`), detokenizing and deltas
(`OutputProcessor.process`), batch building (`InputBatch.prepare`, `InputBatch.sampling_rows`),
scheduling. Prints ms per step and the share of the step for each, and the share outside the model (everything
but forward and LM head). gRPC is not included: the server's event loop runs on another thread.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import time

import common
from pagedserve.config import LINEAR_KERNELS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=32, help="requests decoding together")
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default="auto")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    p.add_argument("--attention-backend", choices=["auto", "cpu", "torch"], default="auto",
                   help="auto: the CPU backend (decodes on the C++ kernel) where the kernels load")
    p.add_argument("--linear-kernels", choices=LINEAR_KERNELS, default="auto",
                   help="EngineConfig.linear_kernels: pagedserve's CPU linear kernels (auto: int8 activations on "
                        "VNNI/AMX where the CPU has them; float-activations: float32 activations) or torch's")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--by-module", action="store_true",
                   help="also time the forward's parts: each linear shape, attention, norms (adds a little overhead; "
                        "runs the Python forward, not the fused decode stack)")
    p.add_argument("--no-fused-decode", action="store_true",
                   help="decode steps on the Python forward, not the one-call C++ stack (models/fused_decode.py)")
    return p.parse_args(argv)


def timed(owner, name: str, label: str, totals: collections.Counter) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``totals[label]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def time_modules(model, backend, parts: collections.Counter) -> None:
    """Time the leaf work of the forward and LM head: every linear and embedding (labelled by class and shape),
    the attention backend's forward, and its elementwise ops (RMSNorm, rotary, SwiGLU)."""
    import dataclasses

    for module in model.modules():
        name = type(module).__name__
        if hasattr(module, "out_features") and hasattr(module, "in_features"):
            timed(module, "forward", f"{name} {module.out_features}x{module.in_features}", parts)
        elif "Embedding" in name:
            timed(module, "forward", name, parts)
    timed(backend, "forward", f"attention ({type(backend).__name__})", parts)
    ops = backend.elementwise
    wrapped = {}
    for field in dataclasses.fields(ops):
        fn = getattr(ops, field.name)
        if not callable(fn):
            continue
        holder = type("Holder", (), {field.name: staticmethod(fn)})
        timed(holder, field.name, f"elementwise {field.name}", parts)
        wrapped[field.name] = getattr(holder, field.name)
    backend.elementwise = dataclasses.replace(ops, **wrapped)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = common.configure_threads(args.threads)
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.sample.sampler import Sampler
    from pagedserve.sampling_params import SamplingParams

    config = EngineConfig(device="cpu", dtype=args.dtype, attention_backend=args.attention_backend, max_num_seqs=args.running,
                          quantization=args.quantization, linear_kernels=args.linear_kernels,
                          kv_cache_dtype=args.kv_cache_dtype,
                          max_model_len=args.prompt_tokens + 2 * args.steps + 80)
    engine, _ = build_engine(config)
    totals: collections.Counter = collections.Counter()
    runner = engine.executor.worker.runner
    timed(runner, "forward", "model forward", totals)
    timed(runner, "compute_logits", "LM head (logits)", totals)
    timed(Sampler, "__call__", "sampler", totals)
    timed(engine.scheduler, "update_from_output", "append / stop checks", totals)
    timed(engine.outputs, "process", "detokenize / deltas", totals)
    timed(runner.input_batch, "prepare", "batch building", totals)
    timed(runner.input_batch, "sampling_rows", "sampling rows", totals)
    parts: collections.Counter = collections.Counter()
    fused = engine.executor.model.fused_decode is not None
    if args.no_fused_decode or args.by_module:
        engine.executor.model.fused_decode = None
    if args.by_module:
        time_modules(engine.executor.model, runner.backend, parts)
    timed(engine.scheduler, "schedule", "scheduler.schedule", totals)
    rng = random.Random(0)
    # room for the tokens decoded while later prompts still prefill (a prompt batch of many requests takes steps)
    params = SamplingParams(max_tokens=2 * args.steps + 64, ignore_eos=True, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k)
    for i in range(args.running):
        engine.add_request(f"r{i}", [rng.randrange(100, engine.vocab_size - 100) for _ in range(args.prompt_tokens)],
                           params)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
        engine.step()
    totals.clear()
    parts.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - start
    assert len(engine.scheduler.running) == args.running, "requests finished early; raise max_tokens"
    print(f"fused decode stack: {'on' if engine.executor.model.fused_decode is not None else 'off'} (available: "
          f"{'yes' if fused else 'no'})")
    kv = str(engine.executor.worker.kv_dtype).removeprefix("torch.")
    print(f"dtype {args.dtype}, KV cache {args.kv_cache_dtype} ({kv}); "
          + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"{args.running} running, {args.prompt_tokens}-token prompts, temperature {args.temperature}, "
          f"top-p {args.top_p}, top-k {args.top_k}: {wall / args.steps * 1e3:.1f} ms per decode step")
    for label, seconds in totals.most_common():
        print(f"  {label:28s} {seconds / args.steps * 1e3:8.2f} ms  {seconds / wall * 100:5.1f}%")
    inside = totals["model forward"] + totals["LM head (logits)"]
    print(f"outside the model (all but forward and LM head): {(wall - inside) / wall * 100:.1f}% of the step")
    if parts:
        print("inside the forward and LM head (summed over layers):")
        for label, seconds in parts.most_common():
            print(f"  {label:40s} {seconds / args.steps * 1e3:8.2f} ms  {seconds / wall * 100:5.1f}%")
        rest = inside - sum(parts.values())
        print(f"  {'rest (residual adds, reshapes, Python)':40s} {rest / args.steps * 1e3:8.2f} ms  "
              f"{rest / wall * 100:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
