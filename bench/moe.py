"""A mixture-of-experts family (Qwen3-MoE, random weights) in pagedserve's engine against HF transformers' generate,
in one process, alternating: prefill tokens/s of one prompt and decode TPOT of one stream.

    .venv/bin/python bench/moe.py [--experts 64 --top-k 8] [--prompt-len 512] [--new-tokens 64] [--repeats 3]

The checkpoint is written by ``save_pretrained`` from ``Qwen3MoeConfig`` with seeded random weights (default: 6
layers, hidden 256, 8/2 heads of 32, 64 experts of 128, top-8 renormalized, the embedded model's vocabulary and
tokenizer) and loaded the way ``--model DIR`` loads it. pagedserve: ``build_engine`` with the CPU defaults
(``--quantization`` as given: ``none`` keeps the float32 weights HF runs, ``int4`` quantizes at load; prefix
caching off, so every repeat prefills in full), greedy, ``ignore_eos``; prefill time is add_request to the first token of a ``max_tokens=1`` request, TPOT is
(last token - first token) / (tokens - 1) of a ``--new-tokens`` request. HF: ``model(ids)`` for prefill, and
``generate(min_new_tokens = max_new_tokens)`` (greedy, KV cache) timed with a streamer for TPOT. Same torch
threads for both. Prints per system the median over ``--repeats`` and the ratios pagedserve / HF (prefill tok/s:
> 1 is faster; TPOT: < 1 is faster).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-ffn", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", choices=["none", "int4", "int8"], default="none")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    return p.parse_args(argv)


def write_checkpoint(args, vocab_size: int, path: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         moe_intermediate_size=args.expert_ffn, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=args.hidden // 8,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                         max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    return model


def ours_once(engine, ids: list[int], n: int) -> tuple[float, float]:
    """(prefill s of ``ids``, TPOT s over ``n`` new tokens)."""
    from pagedserve.sampling_params import SamplingParams

    def run(rid: str, max_tokens: int) -> list[float]:
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        stamps, t0 = [], time.perf_counter()
        while engine.has_unfinished():
            for delta in engine.step():
                stamps += [time.perf_counter() - t0] * len(delta.token_ids)
        return stamps

    prefill = run(f"p{time.monotonic_ns()}", 1)[0]
    stamps = run(f"d{time.monotonic_ns()}", n)
    return prefill, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def hf_once(model, ids: list[int], n: int) -> tuple[float, float]:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        model(x)
        prefill = time.perf_counter() - t0
        s = Stamps()
        model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=s)
    new = s.t[1:]  # the first put() is the prompt
    return prefill, (new[-1] - new[0]) / (len(new) - 1)


def main(argv=None) -> int:
    import random

    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = ModelSource.resolve(None).load_tokenizer()
    path = tempfile.mkdtemp(prefix="moe-bench-")
    hf = write_checkpoint(args, len(tokenizer), path)
    source = ModelSource.resolve(path)
    cfg = source.load_config()
    model = build_model(source, cfg, torch.float32, "cpu", quantization=args.quantization)
    engine, info = build_engine(EngineConfig(device="cpu", dtype="float32", quantization=args.quantization,
                                             enable_prefix_caching=False,  # every repeat prefills in full
                                             num_kv_blocks=(args.prompt_len + args.new_tokens) // 16 + 8,
                                             max_num_batched_tokens=max(2048, args.prompt_len)),
                                model=model, tokenizer=tokenizer, hf_config=cfg)
    ids = random.Random(0).choices(range(3, len(tokenizer)), k=args.prompt_len)
    print(f"Qwen3-MoE random: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of "
          f"{args.expert_ffn}, top-{args.top_k}; prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{args.threads} threads; pagedserve {info.attention_backend} attention, {info.linear_kernels} linears, "
          f"quantization {info.quantization}", flush=True)
    ours_once(engine, ids[:32], 4)  # warm-up: kernels loaded, allocator primed
    hf_once(hf, ids[:32], 4)
    got = {"pagedserve": [], "transformers": []}
    for r in range(args.repeats):
        got["pagedserve"].append(ours_once(engine, ids, args.new_tokens))
        got["transformers"].append(hf_once(hf, ids, args.new_tokens))
        print(f"  repeat {r}: pagedserve prefill {got['pagedserve'][-1][0] * 1e3:.1f} ms, TPOT "
              f"{got['pagedserve'][-1][1] * 1e3:.2f} ms; transformers prefill {got['transformers'][-1][0] * 1e3:.1f}"
              f" ms, TPOT {got['transformers'][-1][1] * 1e3:.2f} ms", flush=True)
    med = {k: (statistics.median(p for p, _ in v), statistics.median(t for _, t in v)) for k, v in got.items()}
    print(f"{'system':<14}{'prefill tok/s':>15}{'TPOT ms':>10}")
    for k, (p, t) in med.items():
        print(f"{k:<14}{args.prompt_len / p:>15.1f}{t * 1e3:>10.2f}")
    print(f"ratio pagedserve/transformers: prefill tok/s {med['transformers'][0] / med['pagedserve'][0]:.2f}x, "
          f"TPOT {med['pagedserve'][1] / med['transformers'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
