"""Prefill of long prompts through the embedded model (SmolLM2-135M, Q4_1 linears as stored, Q8_0 tied LM head),
the quantized linears' paths against each other (float32 activations, int8 activations, the float32 GEMM of the
decoded weights), in one process, taking turns.

    .venv/bin/python bench/prefill.py [--threads 2] [--lengths 256 1024] [--repeats 5] [--greedy 64]

One prefill: the model's forward over a P-token prompt (a fresh paged KV cache, block size 16) and the logits of the
last position, as the engine computes them, for each setting of the same loaded model (SETTINGS below: the defaults
now, "auto"; the defaults before the batch-invariant kernels, "before (dq gemm)", the baseline; and the other
linear_kernels choices), alternated call by call so load from other processes hits all alike; the median of
``--repeats`` calls each is printed as ms, prompt tokens/s and GFLOP/s-equivalent = 2 x params x P / time, where
params are the model's non-embedding parameters (the 30 decoder layers' linears and norms and the final norm: the
tied LM head is the embedding and runs for one position only, so neither it nor attention's score and value products
count), and each setting's speed against the baseline's. The prompt is a fixed English text (Python's bundled
documentation topics).

``--greedy N``: the 16 chat prompts of ``bench/common.py`` (QUICK_PROMPTS) through the engine together, greedy, N
new tokens each (EOS ignored), with each setting; prints how many outputs equal float32 activations' (16 streams
decode together, so decode steps take the int8 path too).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "service"))
sys.path.insert(0, os.path.dirname(__file__))

from common import QUICK_PROMPTS, chat_prompt_ids, configure_threads  # noqa: E402
from pagedserve.attention.base import AttentionMetadata  # noqa: E402
from pagedserve.attention.cpu import CpuAttentionBackend, bf16_matmul_available  # noqa: E402
from pagedserve.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from pagedserve.worker.kv_tensors import allocate_kv_caches  # noqa: E402
from pagedserve.models.cpu_linear import (AMX_MIN_TOKENS, DQ_MIN_TOKENS, VNNI_MAX_TOKENS,  # noqa: E402
                                          amx_available, amx_matches_panels, use_amx, use_dequantized_gemm,
                                          use_int8_activations, use_vnni, vnni_available)
from pagedserve.models.loader import ModelSource  # noqa: E402
from pagedserve.models.registry import build_model  # noqa: E402

# name: (a8_min_tokens, levels, dq_min_tokens, amx_min_tokens, vnni_max_tokens, attention). "auto" is what the
# default server runs (linear_kernels "auto": two-level int8 activations at every call, on the AVX-512 VNNI panels
# where the CPU has them, AMX tiles from 16 tokens where it has AMX-INT8 and they give the panels' bits; attention
# the batch-invariant float32 kernel); "auto, amx off" the same with AMX off (what an AVX-512 CPU without AMX
# runs; only where AMX is there); "int8 x1" one level ("int8-activations"); "avx2 panels x2" the AVX2/AVX-VNNI
# panels alone (an AVX2 CPU's auto); "float32 act" float32 activations ("float-activations"); "before (dq gemm)"
# the defaults before the batch-invariant kernels, the baseline: torch's float32 GEMM of the decoded weights from
# 64 tokens (as vLLM's CPU backend runs weights its kernels cannot take) and torch's SDPA for prefill attention, in
# bf16 where the CPU multiplies bf16 natively.
VNNI = VNNI_MAX_TOKENS if vnni_available() else 0
AMX = AMX_MIN_TOKENS if amx_available() and amx_matches_panels() else 0
BF16 = bf16_matmul_available()
SETTINGS = {"before (dq gemm)": (16, 2, DQ_MIN_TOKENS, 0, 32 if VNNI else 0, "sdpa"),
            "float32 act": (0, 2, 0, 0, 0, "kernel"), "avx2 panels x2": (1, 2, 0, 0, 0, "kernel"),
            "auto": (1, 2, 0, AMX, VNNI, "kernel"), "int8 x1": (1, 1, 0, AMX, VNNI, "kernel")}
if AMX:
    SETTINGS["auto, amx off"] = (1, 2, 0, 0, VNNI, "kernel")


def use_setting(model, setting: tuple) -> object:
    """Set the model's linear paths to ``setting``; returns the attention backend of the setting."""
    use_int8_activations(model, *setting[:2])
    use_dequantized_gemm(model, setting[2])
    use_amx(model, setting[3])
    use_vnni(model, setting[4])
    if setting[5] == "kernel":
        return CpuAttentionBackend()
    backend = TorchAttentionBackend()
    backend.prefill_dtype = torch.bfloat16 if BF16 else None
    return backend


def text_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of Python's documentation topics (pydoc_data), repeated if short."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n".join(topics[key] for key in sorted(topics)))["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


def prefill(model, ids: list[int], backend) -> torch.Tensor:
    """Logits ``[1, vocab]`` of the last position after one forward over ``ids`` with a fresh KV cache."""
    T, bs = len(ids), 16
    nb = -(-T // bs)
    kv = allocate_kv_caches(model.num_layers, nb, bs, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T), block_tables=torch.arange(nb, **i32)[None],
        context_lens=torch.tensor([T], **i32), query_start_loc=torch.tensor([0, T], **i32),
        query_lens=torch.tensor([T], **i32), max_query_len=T, max_context_len=T, num_decode_seqs=0,
        query_lens_cpu=[T], context_lens_cpu=[T])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(T), kv, meta, backend)
        return model.compute_logits(hidden[-1:])


def non_embedding_params(model) -> int:
    """Parameters of the decoder layers and the final norm, quantized layers counted by weights (N x K)."""
    total = 0
    for name, module in model.named_modules():
        if name == "embed_tokens" or name == "lm_head" or list(module.children()):
            continue
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            total += module.in_features * module.out_features
        else:
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


def bench_prefill(model, tokenizer, lengths: list[int], repeats: int) -> None:
    params = non_embedding_params(model)
    print(f"non-embedding parameters: {params / 1e6:.1f} M")
    for n in lengths:
        ids = text_ids(tokenizer, n)
        samples = {key: [] for key in SETTINGS}
        for key, setting in SETTINGS.items():   # warm-up
            prefill(model, ids, use_setting(model, setting))
        for _ in range(repeats):
            for key, setting in SETTINGS.items():
                backend = use_setting(model, setting)
                start = time.perf_counter()
                prefill(model, ids, backend)
                samples[key].append(time.perf_counter() - start)
        med = {key: statistics.median(v) for key, v in samples.items()}
        for key, t in med.items():
            print(f"P={n:5d} {key:12s} {t * 1e3:8.1f} ms  {n / t:7.1f} tok/s  {2 * params * n / t / 1e9:6.1f} "
                  f"GFLOP/s-eq  (min {min(samples[key]) * 1e3:.1f} ms)")
        for key in list(SETTINGS)[1:]:
            print(f"P={n:5d} {key} vs before (dq gemm): {med['before (dq gemm)'] / med[key]:.2f}x faster")


def greedy_outputs(model, tokenizer, cfg, max_tokens: int, backend) -> list[list[int]]:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.sampling_params import SamplingParams

    engine, _ = build_engine(EngineConfig(device="cpu", enforce_eager=True, num_kv_blocks=256), model=model,
                             tokenizer=tokenizer, hf_config=cfg, backend=backend)
    for i, p in enumerate(QUICK_PROMPTS):
        engine.add_request(f"r{i}", chat_prompt_ids(tokenizer, p),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out[f"r{i}"] for i in range(len(QUICK_PROMPTS))]


def bench_greedy(model, tokenizer, cfg, max_tokens: int) -> None:
    outs = {}
    for key, setting in SETTINGS.items():
        outs[key] = greedy_outputs(model, tokenizer, cfg, max_tokens, use_setting(model, setting))
    a = outs["float32 act"]
    for key in [k for k in SETTINGS if k != "float32 act"]:
        b = outs[key]
        same = sum(x == y for x, y in zip(a, b))
        first = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None) for x, y in zip(a, b)]
        print(f"greedy {key} vs float32 act, {len(a)} chat prompts x {max_tokens} tokens: {same}/{len(a)} "
              f"identical; first differing position of the others: {[f for f in first if f is not None]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--greedy", type=int, default=0, help="new tokens per chat prompt (0: skip)")
    args = parser.parse_args()
    print(configure_threads(args.threads))
    source = ModelSource.resolve(None)
    cfg = source.load_config()
    model = build_model(source, cfg, torch.float32, "cpu", quantization="auto")
    if model.a8_min_tokens == 0:
        sys.exit(f"int8 activations unavailable (linear kernels: {model.linear_kernels})")
    tokenizer = source.load_tokenizer()
    bench_prefill(model, tokenizer, args.lengths, args.repeats)
    if args.greedy:
        bench_greedy(model, tokenizer, cfg, args.greedy)


if __name__ == "__main__":
    main()
