"""Launchers of the paged attention kernels (cuda/decode_attention.cu, cuda/prefill_attention*.cu); the torch
reference they must match is :mod:`pagedserve.attention.torch_ref`. Arguments are checked
(:mod:`pagedserve.kernels.checks`) before the current runtime sees them."""
from __future__ import annotations

import numpy as np
import torch

from . import geometry as geo
from .checks import check_attention, check_sliding_window, check_tensor, log2e_scale, softcap_sinks_log2
from .geometry import DecodePlan, plan_decode
from .runtime import current_runtime, module_key


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           context_lens_cpu: list[int] | None = None, plan: DecodePlan | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> None:
    """Decode attention: each of ``S = query.shape[0]`` sequences has one new token attending to its whole
    context through its block table, or to its last ``sliding_window`` tokens (GQA-tiled, split-K over fixed
    256-key partitions at absolute positions with an in-order log-sum-exp merge, so a sequence's output does not
    depend on the other sequences, the plan or the device: cuda/decode_attention.cu).

    Args:
        out: ``[S, num_heads, head_dim]``, written. query: ``[S, num_heads, head_dim]``, rows 16-byte aligned.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, query's dtype.
        block_tables: ``[>= S, max_blocks]`` int32. context_lens: ``[>= S]`` int32 (the first S are used).
        scale: softmax scale. context_lens_cpu: host copy of the S context lengths (for the grid's partition
        slots), or ``plan`` from :func:`pagedserve.kernels.geometry.plan_decode` / ``plan_decode_fixed`` (reusable
        across a step's layers of the same window; its slots must cover every sequence's partitions).
        sliding_window: None, or the keys each query sees counting its own.
        softcap: None, or Gemma 2's soft-cap of the scores. sinks: None, or ``[num_heads]`` gpt-oss sink logits
        (:meth:`pagedserve.attention.base.AttentionBackend.forward`).

    Raises:
        ValueError: on a dtype, shape, stride, alignment or device problem, a window below 1, or a plan made for
            another window (before any CUDA call).
    """
    window = check_sliding_window(sliding_window)
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) else 0
    dtype, (_, block_size, num_kv_heads, head_dim) = check_attention(
        out, query, k_cache, v_cache, block_tables, context_lens, num_seqs)
    scale_log2 = log2e_scale(scale)
    if plan is None and (context_lens_cpu is None or len(context_lens_cpu) != num_seqs):
        raise ValueError(f"context_lens_cpu: need {num_seqs} host context lengths (or a plan)")
    rt = current_runtime()
    ptr = rt.pointer
    device = rt.check_device(out=out, query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                             context_lens=context_lens)
    cap_log2, sinks_log2 = softcap_sinks_log2(softcap, sinks, query.shape[1] if num_seqs else 0, out.device)
    sinks_ptr = np.uint64(0) if sinks_log2 is None else ptr(sinks_log2)
    if num_seqs == 0:
        return
    if num_seqs > 65535:
        raise ValueError(f"query: at most 65535 decode sequences per launch, got {num_seqs}")
    num_heads = query.shape[1]
    if plan is None:
        plan = plan_decode(dtype, context_lens_cpu, num_heads, num_kv_heads, head_dim, block_size,
                           sliding_window=window)
    if plan.sliding_window != window:
        raise ValueError(f"plan: made for sliding_window {plan.sliding_window}, the call has {window}")
    expected_smem = geo.decode_smem_bytes(dtype, head_dim, block_size, plan.gqa_tile)
    if plan.grid[2] != num_seqs or plan.smem_bytes != expected_smem:
        raise ValueError(f"plan: made for {plan.grid[2]} sequences / {plan.smem_bytes} B of shared memory, the "
                         f"call needs {num_seqs} / {expected_smem}")
    parts = plan.num_partitions
    if parts > 1:
        part_out = torch.empty((num_seqs, num_heads, parts, head_dim), dtype=torch.float32, device=device)
        part_stats = torch.empty((2, num_seqs, num_heads, parts), dtype=torch.float32, device=device)
        part_ptrs = (ptr(part_out), ptr(part_stats[0]), ptr(part_stats[1]))
    else:
        part_ptrs = (np.uint64(0),) * 3
    key = module_key(rt, device, "decode", dtype, head_dim, block_size)
    args = (ptr(out), *part_ptrs, ptr(query), ptr(k_cache), ptr(v_cache), ptr(block_tables),
            ptr(context_lens), np.int64(out.stride(0)), np.int64(query.stride(0)), np.int32(block_tables.stride(0)),
            np.int32(num_heads), np.int32(num_kv_heads), np.float32(scale_log2), np.int32(window),
            np.float32(cap_log2), sinks_ptr)
    rt.launch(key, geo.decode_kernel_name(dtype, head_dim, block_size, plan.gqa_tile), device, plan.grid,
              plan.block, args, plan.smem_bytes)
    if parts > 1:
        merge_args = (ptr(out), *part_ptrs, ptr(context_lens), np.int64(out.stride(0)), np.int32(parts),
                      np.int32(window), sinks_ptr)
        rt.launch(key, geo.decode_merge_kernel_name(dtype, head_dim), device, plan.merge_grid, plan.merge_block,
                  merge_args, plan.merge_smem_bytes)


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, *, seq_offset: int, num_prefill_seqs: int, max_query_len: int,
                            sliding_window: int | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> None:
    """Causal attention of the new tokens of sequences ``seq_offset .. seq_offset + num_prefill_seqs - 1`` over
    their cached prefix and themselves (tensor cores for fp16/bf16; for fp32 the decode kernel's partitions and
    arithmetic, so an fp32 prefill row equals the decode of its position bit for bit); under a ``sliding_window``
    W a token at position p sees keys p - W + 1 .. p only. Either way a row's output depends on its query, its
    position and the keys, not on the chunk it came in or the other sequences.

    Args:
        out, query: ``[T, num_heads, head_dim]`` over the step's flattened tokens; only the prefill rows of
            ``out`` are written. query_start_loc: ``[>= seq_offset + num_prefill_seqs + 1]`` int32.
        k_cache, v_cache, block_tables, context_lens: as for :func:`paged_decode_attention` (cache already holds
            the new rows). max_query_len: host int >= every prefill sequence's query length.
        softcap, sinks: as for :func:`paged_decode_attention`.

    Raises:
        ValueError: on a dtype, shape, stride, alignment or device problem, or a window below 1 (before any CUDA
            call).
    """
    window = check_sliding_window(sliding_window)
    total = seq_offset + num_prefill_seqs
    dtype, (_, block_size, num_kv_heads, head_dim) = check_attention(
        out, query, k_cache, v_cache, block_tables, context_lens, total)
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if query_start_loc.shape[0] < total + 1 or seq_offset < 0 or num_prefill_seqs > 65535:
        raise ValueError(f"query_start_loc: need >= {total + 1} entries (seq_offset {seq_offset}, "
                         f"num_prefill_seqs {num_prefill_seqs} <= 65535), got {query_start_loc.shape[0]}")
    scale_log2 = log2e_scale(scale)
    rt = current_runtime()
    ptr = rt.pointer
    device = rt.check_device(out=out, query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                             context_lens=context_lens, query_start_loc=query_start_loc)
    cap_log2, sinks_log2 = softcap_sinks_log2(softcap, sinks, query.shape[1], out.device)
    if num_prefill_seqs <= 0 or max_query_len <= 0:
        return
    num_heads = query.shape[1]
    g = geo.plan_prefill(dtype, head_dim, num_heads, num_prefill_seqs, max_query_len, num_kv_heads, block_size)
    args = (ptr(out), ptr(query), ptr(k_cache), ptr(v_cache), ptr(block_tables), ptr(context_lens),
            ptr(query_start_loc), np.int64(out.stride(0)), np.int64(query.stride(0)), np.int32(block_tables.stride(0)),
            np.int32(num_heads), np.int32(num_kv_heads), np.int32(seq_offset), np.float32(scale_log2),
            np.int32(window), np.float32(cap_log2), np.uint64(0) if sinks_log2 is None else ptr(sinks_log2))
    key = module_key(rt, device, "prefill", dtype, head_dim, block_size)
    name = geo.prefill_kernel_name(dtype, head_dim, block_size, geo.decode_gqa_tile(num_heads, num_kv_heads))
    rt.launch(key, name, device, g.grid, g.block, args, g.smem_bytes)
