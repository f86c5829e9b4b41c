"""CPU backend: every query row of a step, prefill chunks and decodes alike, on pagedserve's C++ paged-attention kernel.

Rows read their context straight from the paged KV cache through the block table (``torch.ops.pagedserve_cpu.
paged_attention`` for a step with prefill rows, ``paged_decode_attention`` for a decode-only one; the same kernel,
``kernels/csrc/attention.cpp``), instead of the reference's gather of every block into a buffer followed by a masked
SDPA per group. The kernel is batch-invariant: a row's output is a fixed function of its query and the keys and values
it sees, the same bit for bit whether the row is a decode or part of a prefill chunk, however its prompt was chunked,
whatever else shares the step and however the work falls on threads (the lane-wise scheme of
``csrc/attention_lanes.hpp``); with the batch-invariant linears this is what gives a request the same tokens alone or
beside others (README, "Deterministic outputs"). Sliding windows, soft-capping and attention sinks run in it too.
float32 queries with a float32, float16 or bfloat16 cache (``--kv-cache-dtype``: rows rounded when written, widened
exactly when read); other dtypes, and a CPU where the kernels do not load, get the reference path throughout. The
model's RMSNorm, rotary embedding and SwiGLU run on the C++ elementwise kernels
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
    """:class:`TorchAttentionBackend` with every row on the C++ kernel (float32, head_dim a multiple of 8).

    Same contract: writes the step's K/V rows (``reshape_and_cache``; on the C++ path the kernel of that name, which
    skips slot -1 rows likewise), then returns ``[T, num_heads, head_dim]``.
    """

    name = "cpu"
    elementwise = CPU_OPS

    def kernel_name(self) -> str:
        if cpu_kernel_ops() is None:
            return "torch reference (CPU kernels not loaded)"
        lanes = 16 if torch.ops.pagedserve_cpu.paged_attention_lanes() == 16 else 8
        return f"batch-invariant paged attention, {lanes} lanes ({'AVX-512' if lanes == 16 else 'AVX2'})"

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, *,
                softcap=None, sinks=None):
        if query.dtype != torch.float32 or k_cache.dtype not in _CACHE_DTYPES or query.shape[-1] % 8 or \
                query.device.type != "cpu":
            return super().forward(query, key, value, k_cache, v_cache, meta, scale, sliding_window, softcap=softcap,
                                   sinks=sinks)
        window = check_sliding_window(sliding_window)
        check_softcap_sinks(softcap, sinks, query.shape[1])
        self._check_kv(query, key, value, k_cache)
        torch.ops.pagedserve_cpu.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        sinks = None if sinks is None else sinks.float().contiguous()
        nd = meta.num_decode_seqs
        if nd == meta.num_seqs:   # decodes only (a compiled step's padded rows past them get zeros)
            decode = torch.ops.pagedserve_cpu.paged_decode_attention(
                query[:nd].contiguous(), k_cache, v_cache, meta.block_tables[:nd].contiguous(),
                meta.context_lens[:nd], float(scale), 0, window, float(softcap or 0.0), sinks)
            if query.shape[0] == nd:
                return decode
            out = query.new_zeros(query.shape)
            out[:nd] = decode
            return out
        return torch.ops.pagedserve_cpu.paged_attention(
            query.contiguous(), k_cache, v_cache, meta.block_tables.contiguous(), meta.query_start_loc,
            meta.context_lens, float(scale), window, float(softcap or 0.0), sinks)


def bf16_matmul_available() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX512-BF16), where torch's flash kernel runs
    bf16 attention about 2.5x faster than float32 (1,024 causal tokens, 9 heads of 64: 2.3 vs 6.0 ms per layer)."""
    checks = (getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    return any(bool(check()) for check in checks if check is not None)
