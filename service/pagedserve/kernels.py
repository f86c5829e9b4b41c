"""CUDA kernels from ``cuda/``, compiled at run time with NVRTC through ``cupy.RawModule`` and launched on torch
tensors (by data pointer, no copies) on torch's current CUDA stream.

Every launcher checks dtype, shape, strides, alignment and device first and raises :class:`ValueError` naming the
argument before any CUDA call. Geometry comes from :mod:`pagedserve.kernel_geometry` (pure Python); compilation
and the per-configuration module cache from :mod:`pagedserve.kernel_build`; streams and launching from
:mod:`pagedserve.kernel_launch`. The torch references these kernels
must match are :mod:`pagedserve.attention.torch_ref` and :mod:`pagedserve.ops`.
"""
from __future__ import annotations

import numpy as np
import torch

from . import kernel_geometry as geo
from .kernel_build import (  # noqa: F401 - re-exported: the public compile API lives here too
    CubinResult, KernelCompileError, ModuleKey, compile_to_cubin, cuda_include_dirs, get_kernel, load_source,
    nvrtc_available, parse_ptxas_log, set_source_dir)
from .kernel_launch import device_arch, launch, num_sms  # noqa: F401 - device_arch re-exported
from .kernel_launch import module_key as _key, tensor_ptr as _ptr
from .kernel_geometry import DecodePlan, check_aligned, check_cuda, check_tensor, plan_decode


# ---- paged KV cache ---------------------------------------------------------------------------------------------
def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` rows into the paged caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` at ``slot_mapping`` (``[T]`` int64; ``< 0`` skipped).
    Same semantics as :func:`pagedserve.attention.torch_ref.reshape_and_cache`. Slots must be < num_blocks *
    block_size (not checked: that would need a device sync)."""
    check_tensor("key", key, ndim=3)
    geo.dtype_name(key.dtype, "key")
    if isinstance(k_cache, torch.Tensor) and key.dtype != k_cache.dtype:
        raise ValueError(f"key: dtype {key.dtype} does not match k_cache dtype {k_cache.dtype}")
    _, _, num_kv_heads, head_dim = geo.check_cache_shape(k_cache, v_cache, key.dtype)
    check_tensor("key", key, ndim=3, shape=(None, num_kv_heads, head_dim), inner_contiguous=2)
    check_tensor("value", value, dtypes=(key.dtype,), shape=tuple(key.shape), inner_contiguous=2)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(key.shape[0],), ndim=1,
                 contiguous=True)
    device = check_cuda(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if key.shape[0] == 0:
        return
    es = key.element_size()
    row_bytes = num_kv_heads * head_dim * es
    unit = geo.copy_unit_bytes(key.data_ptr(), value.data_ptr(), key.stride(0) * es, value.stride(0) * es,
                               row_bytes)
    g = geo.plan_rows(key.shape[0], row_bytes // unit, max_threads=256)
    args = (_ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slot_mapping),
            np.int64(key.stride(0) * es // unit), np.int64(value.stride(0) * es // unit), np.int32(row_bytes // unit))
    launch(_key(device, "cache"), geo.reshape_and_cache_kernel_name(unit), device, g.grid, g.block, args)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For each ``(src, dst)`` row of ``block_mapping`` (``[num_pairs, 2]`` int64), copy block ``src`` to block
    ``dst`` in every layer's K and V cache (copy-on-write). All caches share one shape and dtype."""
    if not k_caches or len(k_caches) != len(v_caches):
        raise ValueError("k_caches: need one or more layers and as many v_caches")
    check_tensor("k_caches[0]", k_caches[0])
    first = k_caches[0]
    geo.dtype_name(first.dtype, "k_caches")
    for i, (k, v) in enumerate(zip(k_caches, v_caches)):
        check_tensor(f"k_caches[{i}]", k, dtypes=(first.dtype,), shape=tuple(first.shape), ndim=first.dim(),
                     contiguous=True)
        check_tensor(f"v_caches[{i}]", v, dtypes=(first.dtype,), shape=tuple(first.shape), ndim=first.dim(),
                     contiguous=True)
    check_tensor("block_mapping", block_mapping, dtypes=(torch.int64,), ndim=2, shape=(None, 2), contiguous=True)
    if block_mapping.shape[0] > 65535:
        raise ValueError(f"block_mapping: at most 65535 pairs per call, got {block_mapping.shape[0]}")
    device = check_cuda(block_mapping=block_mapping, **{f"k_caches[{i}]": k for i, k in enumerate(k_caches)},
                        **{f"v_caches[{i}]": v for i, v in enumerate(v_caches)})
    if block_mapping.shape[0] == 0:
        return
    block_bytes = first[0].numel() * first.element_size()
    caches = list(k_caches) + list(v_caches)
    unit = geo.copy_unit_bytes(block_bytes, *(c.data_ptr() for c in caches))
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(device, non_blocking=True)
    num_layers = len(k_caches)
    g = geo.plan_rows(num_layers, block_bytes // unit, max_threads=512)
    args = (_ptr(ptrs), np.uint64(ptrs.data_ptr() + 8 * num_layers), _ptr(block_mapping),
            np.int64(block_bytes // unit))
    launch(_key(device, "cache"), geo.copy_blocks_kernel_name(unit), device, (num_layers, block_mapping.shape[0], 1),
            g.block, args)


# ---- attention ----------------------------------------------------------------------------------------------------
def _check_attention(out, query, k_cache, v_cache, block_tables, context_lens, num_seqs: int):
    """Shared checks of the decode and prefill launchers; returns (dtype name, cache shape)."""
    dtype = geo.dtype_name(query.dtype, "query")
    cache_shape = geo.check_cache_shape(k_cache, v_cache, query.dtype)
    _, _, num_kv_heads, head_dim = cache_shape
    check_tensor("query", query, ndim=3, shape=(None, None, head_dim), inner_contiguous=2)
    geo.check_heads(query.shape[1], num_kv_heads)
    check_tensor("out", out, dtypes=(query.dtype,), shape=tuple(query.shape), ndim=3, inner_contiguous=2)
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, shape=(None, None))
    if block_tables.shape[0] < num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: need >= {num_seqs} rows with unit column stride, got shape "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if context_lens.shape[0] < num_seqs:
        raise ValueError(f"context_lens: need >= {num_seqs} entries, got {context_lens.shape[0]}")
    check_aligned("query", query)
    check_aligned("out", out, align=4)
    return dtype, cache_shape


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           context_lens_cpu: list[int] | None = None, plan: DecodePlan | None = None) -> None:
    """Decode attention: each of ``S = query.shape[0]`` sequences has one new token attending to its whole
    context through its block table (GQA-tiled, split-K with a log-sum-exp merge for long contexts).

    Args:
        out: ``[S, num_heads, head_dim]``, written. query: ``[S, num_heads, head_dim]``, rows 16-byte aligned.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, query's dtype.
        block_tables: ``[>= S, max_blocks]`` int32. context_lens: ``[>= S]`` int32 (the first S are used).
        scale: softmax scale. context_lens_cpu: host copy of the S context lengths (for the split plan), or
        ``plan`` from :func:`pagedserve.kernel_geometry.plan_decode` (reusable across a step's layers).

    Raises:
        ValueError: on a dtype, shape, stride, alignment or device problem (before any CUDA call).
    """
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) else 0
    dtype, (_, block_size, num_kv_heads, head_dim) = _check_attention(
        out, query, k_cache, v_cache, block_tables, context_lens, num_seqs)
    scale_log2 = geo.log2e_scale(scale)
    if plan is None and (context_lens_cpu is None or len(context_lens_cpu) != num_seqs):
        raise ValueError(f"context_lens_cpu: need {num_seqs} host context lengths (or a plan)")
    device = check_cuda(out=out, query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                        context_lens=context_lens)
    if num_seqs == 0:
        return
    if num_seqs > 65535:
        raise ValueError(f"query: at most 65535 decode sequences per launch, got {num_seqs}")
    num_heads = query.shape[1]
    if plan is None:
        plan = plan_decode(dtype, context_lens_cpu, num_heads, num_kv_heads, head_dim, block_size,
                           num_sms(device.index))
    expected_smem = geo.decode_smem_bytes(dtype, head_dim, block_size, plan.gqa_tile)
    if plan.grid[2] != num_seqs or plan.smem_bytes != expected_smem:
        raise ValueError(f"plan: made for {plan.grid[2]} sequences / {plan.smem_bytes} B of shared memory, the "
                         f"call needs {num_seqs} / {expected_smem}")
    parts = plan.num_partitions
    if parts > 1:
        part_out = torch.empty((num_seqs, num_heads, parts, head_dim), dtype=torch.float32, device=device)
        part_stats = torch.empty((2, num_seqs, num_heads, parts), dtype=torch.float32, device=device)
        part_ptrs = (_ptr(part_out), _ptr(part_stats[0]), _ptr(part_stats[1]))
    else:
        part_ptrs = (np.uint64(0),) * 3
    key = _key(device, "decode", dtype, head_dim, block_size)
    args = (_ptr(out), *part_ptrs, _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables),
            _ptr(context_lens), np.int64(out.stride(0)), np.int64(query.stride(0)), np.int32(block_tables.stride(0)),
            np.int32(num_heads), np.int32(num_kv_heads), np.int32(plan.partition_size), np.float32(scale_log2))
    launch(key, geo.decode_kernel_name(dtype, head_dim, block_size, plan.gqa_tile), device, plan.grid, plan.block,
           args, plan.smem_bytes)
    if parts > 1:
        merge_args = (_ptr(out), *part_ptrs, _ptr(context_lens), np.int64(out.stride(0)), np.int32(parts),
                      np.int32(plan.partition_size))
        launch(key, geo.decode_merge_kernel_name(dtype, head_dim), device, plan.merge_grid, plan.merge_block,
               merge_args, plan.merge_smem_bytes)


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, *, seq_offset: int, num_prefill_seqs: int, max_query_len: int) -> None:
    """Causal attention of the new tokens of sequences ``seq_offset .. seq_offset + num_prefill_seqs - 1`` over
    their cached prefix and themselves (tensor cores for fp16/bf16, a scalar kernel for fp32).

    Args:
        out, query: ``[T, num_heads, head_dim]`` over the step's flattened tokens; only the prefill rows of
            ``out`` are written. query_start_loc: ``[>= seq_offset + num_prefill_seqs + 1]`` int32.
        k_cache, v_cache, block_tables, context_lens: as for :func:`paged_decode_attention` (cache already holds
            the new rows). max_query_len: host int >= every prefill sequence's query length.

    Raises:
        ValueError: on a dtype, shape, stride, alignment or device problem (before any CUDA call).
    """
    total = seq_offset + num_prefill_seqs
    dtype, (_, block_size, num_kv_heads, head_dim) = _check_attention(
        out, query, k_cache, v_cache, block_tables, context_lens, total)
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if query_start_loc.shape[0] < total + 1 or seq_offset < 0 or num_prefill_seqs > 65535:
        raise ValueError(f"query_start_loc: need >= {total + 1} entries (seq_offset {seq_offset}, "
                         f"num_prefill_seqs {num_prefill_seqs} <= 65535), got {query_start_loc.shape[0]}")
    scale_log2 = geo.log2e_scale(scale)
    device = check_cuda(out=out, query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                        context_lens=context_lens, query_start_loc=query_start_loc)
    if num_prefill_seqs <= 0 or max_query_len <= 0:
        return
    num_heads = query.shape[1]
    g = geo.plan_prefill(dtype, head_dim, num_heads, num_prefill_seqs, max_query_len)
    args = (_ptr(out), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(context_lens),
            _ptr(query_start_loc), np.int64(out.stride(0)), np.int64(query.stride(0)), np.int32(block_tables.stride(0)),
            np.int32(num_heads), np.int32(num_kv_heads), np.int32(seq_offset), np.float32(scale_log2))
    launch(_key(device, "prefill", dtype, head_dim, block_size), geo.prefill_kernel_name(dtype, head_dim, block_size),
            device, g.grid, g.block, args, g.smem_bytes)


# ---- elementwise layers -------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA :func:`pagedserve.ops.rms_norm`: ``x`` ``[..., hidden]`` (last dim contiguous), ``weight``
    ``[hidden]`` and optional ``residual`` like ``x``, one dtype. Returns ``(normed, x + residual)`` (or
    ``(normed, x)`` without residual), new contiguous tensors except that second ``x``."""
    dtype = geo.dtype_name(x.dtype, "x")
    check_tensor("x", x, inner_contiguous=1)
    hidden = x.shape[-1]
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=1, shape=(hidden,), contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape), ndim=x.dim(), inner_contiguous=1)
    if x.dim() < 1 or hidden == 0:
        raise ValueError(f"x: need a non-empty last dim, got shape {tuple(x.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    tensors = {"x": x, "weight": weight} | ({"residual": residual} if residual is not None else {})
    device = check_cuda(**tensors)
    x2 = x.reshape(-1, hidden)
    r2 = residual.reshape(-1, hidden) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=x.dtype, device=device)
    res_out = torch.empty_like(out) if residual is not None else out
    if x2.shape[0]:
        es = x.element_size()
        vec = geo.vec_for_rows(dtype, hidden, x2.data_ptr(), x2.stride(0) * es, r2.data_ptr(), r2.stride(0) * es,
                               weight.data_ptr())
        g = geo.plan_rows(x2.shape[0], hidden // vec)
        args = (_ptr(out), _ptr(res_out), _ptr(x2), _ptr(r2), _ptr(weight), np.int64(x2.stride(0)),
                np.int64(r2.stride(0)), np.int32(hidden), np.float32(eps))
        launch(_key(device, "elementwise", dtype), geo.rms_norm_kernel_name(dtype, vec, residual is not None),
               device, g.grid, g.block, args)
    new_residual = res_out.view(x.shape) if residual is not None else x
    return out.view(x.shape), new_residual


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> torch.Tensor:
    """CUDA :func:`pagedserve.ops.rotary_embedding`: ``positions`` ``[T]`` int64 (each < max_position, not
    checked), ``x`` ``[T, num_heads, head_dim]`` (head_dim contiguous, any token/head strides), ``cos_sin_cache``
    ``[max_position, head_dim]`` fp32 contiguous. Returns a new contiguous ``[T, num_heads, head_dim]``."""
    dtype = geo.dtype_name(x.dtype, "x")
    check_tensor("x", x, ndim=3, inner_contiguous=1)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: head_dim must be even, got {head_dim}")
    check_tensor("positions", positions, dtypes=(torch.int64,), ndim=1, shape=(num_tokens,), contiguous=True)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), ndim=2, shape=(None, head_dim),
                 contiguous=True)
    device = check_cuda(positions=positions, x=x, cos_sin_cache=cos_sin_cache)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=device)
    if num_tokens and num_heads:
        g = geo.plan_rows(num_tokens, num_heads * head_dim // 2, max_threads=512)
        args = (_ptr(out), _ptr(x), _ptr(positions), _ptr(cos_sin_cache), np.int64(x.stride(0)),
                np.int64(x.stride(1)), np.int32(num_heads), np.int32(head_dim))
        launch(_key(device, "elementwise", dtype), geo.rotary_kernel_name(dtype, is_neox), device, g.grid, g.block,
               args)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """CUDA :func:`pagedserve.ops.silu_and_mul`: ``x`` ``[..., 2 * d]`` (last dim contiguous) to a new
    ``[..., d]`` holding ``silu(x[..., :d]) * x[..., d:]``."""
    dtype = geo.dtype_name(x.dtype, "x")
    check_tensor("x", x, inner_contiguous=1)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even (gate then up), got shape {tuple(x.shape)}")
    device = check_cuda(x=x)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=device)
    if x2.shape[0] and d:
        es = x.element_size()
        vec = geo.vec_for_rows(dtype, d, x2.data_ptr(), x2.stride(0) * es, d * es)
        g = geo.plan_silu_and_mul(x2.shape[0], d // vec)
        args = (_ptr(out), _ptr(x2), np.int64(x2.stride(0)), np.int32(d))
        launch(_key(device, "elementwise", dtype), geo.silu_and_mul_kernel_name(dtype, vec), device, g.grid,
               g.block, args)
    return out.view(*x.shape[:-1], d)
