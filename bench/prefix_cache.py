"""Prefix-cache benchmark: TTFT of a request sharing a 1,000-token system prompt, cold vs warm, in one run.

    python bench/prefix_cache.py [--system-tokens 1000] [--repeats 3]

Runs the engine in-process on the embedded model (CPU, fp32). For each repeat: a fresh engine, then request A
(system prompt + question A: cold), then request B (same system prompt + question B: warm). Prints each TTFT, the
prefix-cache hit tokens and the ratio cold/warm. A third column runs B on an engine with prefix caching off, as the
baseline the cache must beat.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def ttft_s(engine, rid: str, prompt: list[int]) -> float:
    from pagedserve.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        if any(d.token_ids for d in engine.step()):
            return time.perf_counter() - start
    raise RuntimeError("no token produced")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    src = ModelSource.resolve(None)
    cfg, tok = src.load_config(), src.load_tokenizer()
    model = build_model(src, cfg, torch.float32, "cpu")
    rng = random.Random(0)
    system = [rng.randrange(100, 49000) for _ in range(args.system_tokens)]
    q_a = [rng.randrange(100, 49000) for _ in range(24)]
    q_b = [rng.randrange(100, 49000) for _ in range(24)]

    def engine(caching: bool):
        return build_engine(EngineConfig(device="cpu", dtype="float32", attention_backend="torch",
                                         enable_prefix_caching=caching, num_kv_blocks=256),
                            model=model, tokenizer=tok, hf_config=cfg)[0]

    ttft_engine = engine(True)
    ttft_s(ttft_engine, "warmup", q_a)  # first-call overheads out of the way
    cold, warm, off, hits = [], [], [], []
    for r in range(args.repeats):
        e = engine(True)
        cold.append(ttft_s(e, f"a{r}", system + q_a))
        before = e.kv_cache.stats.hits_tokens
        warm.append(ttft_s(e, f"b{r}", system + q_b))
        hits.append(e.kv_cache.stats.hits_tokens - before)
        off.append(ttft_s(engine(False), f"c{r}", system + q_b))
    med = statistics.median
    print(f"system prompt {args.system_tokens} tokens, question 24 tokens, {args.repeats} repeats (median)")
    print(f"  TTFT cold (first request)        {med(cold) * 1e3:8.1f} ms")
    print(f"  TTFT warm (prefix-cache hit)     {med(warm) * 1e3:8.1f} ms   hit tokens {hits}")
    print(f"  TTFT with prefix caching off     {med(off) * 1e3:8.1f} ms")
    print(f"  ratio cold / warm                {med(cold) / med(warm):8.2f}x")
    print(f"  ratio caching-off / warm         {med(off) / med(warm):8.2f}x")


if __name__ == "__main__":
    main()
