"""CPU backend: the torch reference for prefill chunks, pagedserve's C++ paged decode-attention kernel for decodes.

Decode rows read their context straight from the paged KV cache through the block table
(``torch.ops.pagedserve_cpu.paged_decode_attention``, ``kernels/csrc/attention.cpp``), instead of the reference's
gather of every block into a buffer followed by a masked SDPA per group, which at 32 running requests with 300-token
contexts copies about 440 MB of K/V per step. Prefill chunks keep the reference path (torch's CPU flash kernel).
float32 queries with a float32, float16 or bfloat16 cache (``--kv-cache-dtype``: rows rounded when written, widened
exactly when read); other dtypes, and a CPU where the kernels do not load, get the reference path throughout.
Soft-capping and attention sinks run in the C++ decode kernel too; prefill chunks with them take the reference's
float32 math path (:func:`~.torch_ref.softmax_attention`). The model's RMSNorm, rotary embedding and SwiGLU run on the C++ elementwise kernels
(:data:`pagedserve.kernels.cpu_elementwise.CPU_OPS`, reference fallback likewise).
"""
from __future__ import annotations

import torch

from ..kernels.cpu_build import cpu_kernel_ops
from ..kernels.cpu_elementwise import CPU_OPS
from ..kernels.checks import check_sliding_window, check_softcap_sinks
from .base import AttentionMetadata
from .torch_ref import TorchAttentionBackend, paged_attention_ref


_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # what the C++ kernels read and write (F16C)


def cpu_decode_kernel_available() -> bool:
    """Whether the C++ decode kernel loaded (AVX2 + FMA CPU and a C++ compiler; see kernels.cpu_build)."""
    return cpu_kernel_ops() is not None


class CpuAttentionBackend(TorchAttentionBackend):
    """:class:`TorchAttentionBackend` with decode rows on the C++ kernel (float32, head_dim a multiple of 8).

    Same contract: writes the step's K/V rows (``reshape_and_cache``; on the C++ path the kernel of that name, which
    skips slot -1 rows likewise), then returns ``[T, num_heads, head_dim]``.
    """

    name = "cpu"
    elementwise = CPU_OPS

    def __init__(self, prefill_dtype: torch.dtype | None = None):
        """``prefill_dtype``: None (prefill attention in the query's dtype), or bfloat16: float32 prefill rows' SDPA
        on bf16 q/k/v with fp32 accumulation (see :func:`use_bf16_prefill_attention`). The KV cache and decode rows
        are unaffected."""
        super().__init__()
        self.prefill_dtype = prefill_dtype

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, *,
                softcap=None, sinks=None):
        nd = meta.num_decode_seqs
        if nd == 0 or query.dtype != torch.float32 or k_cache.dtype not in _CACHE_DTYPES or query.shape[-1] % 8 or \
                query.device.type != "cpu":
            return super().forward(query, key, value, k_cache, v_cache, meta, scale, sliding_window, softcap=softcap,
                                   sinks=sinks)
        window = check_sliding_window(sliding_window)
        check_softcap_sinks(softcap, sinks, query.shape[1])
        self._check_kv(query, key, value, k_cache)
        torch.ops.pagedserve_cpu.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        decode = torch.ops.pagedserve_cpu.paged_decode_attention(
            query[:nd].contiguous(), k_cache, v_cache, meta.block_tables[:nd].contiguous(), meta.context_lens[:nd],
            float(scale), 0, window, float(softcap or 0.0), None if sinks is None else sinks.float().contiguous())
        if nd == meta.num_seqs:
            if query.shape[0] == nd:
                return decode
            out = query.new_zeros(query.shape)   # a compiled step's padded rows (slot -1, past the real tokens)
            out[:nd] = decode
            return out
        out = paged_attention_ref(query, k_cache, v_cache, meta, scale, self._step_plan(meta, k_cache.shape[1]), key,
                                  value, self._workspace, self.prefill_dtype, sliding_window, decodes=False,
                                  softcap=softcap, sinks=sinks)
        out[:nd] = decode
        return out


def bf16_matmul_available() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX512-BF16), where torch's flash kernel runs
    bf16 attention about 2.5x faster than float32 (1,024 causal tokens, 9 heads of 64: 2.3 vs 6.0 ms per layer)."""
    checks = (getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    return any(bool(check()) for check in checks if check is not None)


def use_bf16_prefill_attention(backend, model) -> bool:
    """Give a :class:`CpuAttentionBackend` bfloat16 prefill attention when the model's prefill already runs on
    approximate numerics (its quantized linears take int8 activations: ``model.a8_min_tokens`` > 0, the
    ``linear_kernels`` choices "auto" and "int8-activations") and the CPU multiplies bf16 natively. Exact choices
    ("float-activations", float32 weights) keep float32 attention. Returns whether it was set.

    Agreement (tests/models/test_quant.py, the embedded model, 2,000 teacher-forced tokens, against the dequantized
    float32 model): top-1 and perplexity are checked with this attention on, as for the int8 activations alone.
    """
    if not isinstance(backend, CpuAttentionBackend) or not getattr(model, "a8_min_tokens", 0) or \
            not bf16_matmul_available():
        return False
    backend.prefill_dtype = torch.bfloat16
    return True
