"""Prefill of long prompts through the embedded model (SmolLM2-135M, Q4_1 linears as stored, Q8_0 tied LM head),
the quantized linears' paths against each other (float32 activations, int8 activations, the float32 GEMM of the
decoded weights), in one process, taking turns.

    .venv/bin/python bench/prefill.py [--threads 2] [--lengths 256 1024] [--repeats 5] [--greedy 64]

One prefill: the model's forward over a P-token prompt (pagedserve's CPU attention backend as the engine uses it, a
fresh paged KV cache, block size 16) and the logits of the last position, as the engine computes them. The
settings (five or six: the AMX ones where the CPU has AMX-INT8) are the same loaded model with ``a8_min_tokens`` set to 0 (float32 activations: ``linear_q4`` /
``linear_q8``) or :data:`~pagedserve.models.cpu_linear.A8_MIN_TOKENS` (int8 activations: ``linear_q4_a8`` /
``linear_q8_a8``) in two levels or one ("int8-activations"), or with ``dq_min_tokens`` at
:data:`~pagedserve.models.cpu_linear.DQ_MIN_TOKENS` too ("dq gemm", linear_kernels "auto": ``dequantize_q4`` /
``_q8`` and torch's float32 GEMM), prefill attention in bf16 where an engine would run it so (the settings with
int8 activations, on a CPU with native bf16; "amx x2 fp32 attn" keeps float32), alternated call by call so load
from other processes hits both alike; the median of ``--repeats`` calls each is printed as ms, prompt tokens/s and
GFLOP/s-equivalent = 2 x params x P / time, where params are the model's non-embedding parameters (the 30 decoder
layers' linears and norms and the final norm: the tied LM head is the embedding and runs for one position only, so
neither it nor attention's score and value products count). The prompt is a fixed English text (Python's bundled
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
from pagedserve.worker.kv_tensors import allocate_kv_caches  # noqa: E402
from pagedserve.models.cpu_linear import (A8_MIN_TOKENS, AMX_MIN_TOKENS, DQ_MIN_TOKENS, VNNI_MAX_TOKENS,  # noqa: E402
                                          amx_available, use_amx, use_dequantized_gemm, use_int8_activations,
                                          use_vnni, vnni_available)
from pagedserve.models.loader import ModelSource  # noqa: E402
from pagedserve.models.registry import build_model  # noqa: E402

# name: (a8_min_tokens, levels, dq_min_tokens, amx_min_tokens, vnni_max_tokens, bf16 prefill attention); "float32 act" the own float kernels
# alone, "int8 x2" / "int8 x1" int8 activations in two levels / one, "dq gemm" the float32 GEMM of the decoded weights
# from DQ_MIN_TOKENS, "amx x2" / "amx x1" int8 activations on AMX tiles from AMX_MIN_TOKENS (only where AMX-INT8
# runs), and up to VNNI_MAX_TOKENS on the AVX-512 VNNI panels where the CPU has them (decode steps; a prefill of 256+
# tokens never takes them). linear_kernels "auto" is "amx x2" with AMX, else "dq gemm" (plus the VNNI panels where
# present); "int8-activations" is "amx x1" with AMX, else "int8 x1".
# The last element: whether prefill attention runs in bf16, as an engine sets it (attention.cpu.
# use_bf16_prefill_attention: int8 activations on, and the CPU multiplies bf16 natively); "amx x2 fp32 attn" is
# "amx x2" with float32 attention, to show what the bf16 attention gives.
VNNI = VNNI_MAX_TOKENS if vnni_available() else 0
BF16 = bf16_matmul_available()
SETTINGS = {"float32 act": (0, 2, 0, 0, 0, False), "int8 x2": (A8_MIN_TOKENS, 2, 0, 0, 0, BF16),
            "int8 x1": (A8_MIN_TOKENS, 1, 0, 0, 0, BF16), "dq gemm": (A8_MIN_TOKENS, 2, DQ_MIN_TOKENS, 0, VNNI, BF16)}
if amx_available():
    SETTINGS.update({"amx x2": (A8_MIN_TOKENS, 2, DQ_MIN_TOKENS, AMX_MIN_TOKENS, VNNI, BF16),
                     "amx x1": (A8_MIN_TOKENS, 1, DQ_MIN_TOKENS, AMX_MIN_TOKENS, VNNI, BF16)})
    if BF16:
        SETTINGS["amx x2 fp32 attn"] = (A8_MIN_TOKENS, 2, DQ_MIN_TOKENS, AMX_MIN_TOKENS, VNNI, False)


def use_setting(model, setting: tuple[int, int, int, int, int, bool]) -> CpuAttentionBackend:
    """Set the model's linear paths to ``setting``; returns the attention backend of the setting."""
    use_int8_activations(model, *setting[:2])
    use_dequantized_gemm(model, setting[2])
    use_amx(model, setting[3])
    use_vnni(model, setting[4])
    return CpuAttentionBackend(prefill_dtype=torch.bfloat16 if setting[5] else None)


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
            print(f"P={n:5d} {key} vs float32 activations: {med['float32 act'] / med[key]:.2f}x faster")


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
    for key in list(SETTINGS)[1:]:
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
