"""Reference paged attention in plain torch: the oracle for the CUDA kernels and the CPU path.

Semantics are those of :class:`pagedserve.attention.base.AttentionBackend`. Decodes (one new token each) run as one
batched SDPA over K/V gathered through the block tables; prefill chunks run one sequence at a time with a causal
mask offset by the cached prefix length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into the paged cache in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64; slot ``s`` is block ``s // block_size``, offset ``s % block_size``; ``s < 0``
            is padding and is skipped.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping if bool(valid.all()) else slot_mapping[valid]
    if not bool(valid.all()):
        key, value = key[valid], value[valid]
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slots, value)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Read one sequence's first ``num_tokens`` rows from the paged cache.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[max_blocks]`` int32 physical block ids.
        num_tokens: context length to read.

    Returns:
        ``[num_tokens, num_kv_heads, head_dim]`` (a copy).
    """
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    rows = cache[block_table[:num_blocks].long()]
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:num_tokens]


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the step's new tokens over their paged contexts (no cache write).

    Args:
        query: ``[T, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding this step's rows.
        meta: the step's metadata.
        scale: softmax scale.

    Returns:
        ``[T, num_heads, head_dim]``, query's dtype. Softmax is computed in fp32 for fp16/bf16 inputs.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    nd = meta.num_decode_seqs
    if nd > 0:
        _decode_batch(query[:nd], k_cache, v_cache, meta, scale, out[:nd], compute_dtype, gqa)
    starts = meta.query_start_loc.tolist() if nd < meta.num_seqs else []
    for i in range(nd, meta.num_seqs):
        q_len, ctx_len = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
        q = query[starts[i]:starts[i] + q_len]
        k = gather_kv(k_cache, meta.block_tables[i], ctx_len)
        v = gather_kv(v_cache, meta.block_tables[i], ctx_len)
        # Query row r sits at absolute position ctx_len - q_len + r and sees keys 0..that position.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(compute_dtype), k.transpose(0, 1).to(compute_dtype),
            v.transpose(0, 1).to(compute_dtype), attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[starts[i]:starts[i] + q_len] = o.transpose(0, 1).to(query.dtype)
    return out


def _decode_batch(query, k_cache, v_cache, meta, scale, out, compute_dtype, gqa) -> None:
    """Batched decode: ``query`` ``[nd, H, D]``, one token per sequence, K/V gathered to the longest context."""
    nd = query.shape[0]
    block_size = k_cache.shape[1]
    max_ctx = max(meta.context_lens_cpu[:nd])
    num_blocks = (max_ctx + block_size - 1) // block_size
    tables = meta.block_tables[:nd, :num_blocks].long()
    k = k_cache[tables].reshape(nd, num_blocks * block_size, *k_cache.shape[2:])
    v = v_cache[tables].reshape(nd, num_blocks * block_size, *v_cache.shape[2:])
    ctx = meta.context_lens[:nd].to(torch.long)
    mask = torch.arange(num_blocks * block_size, device=query.device)[None, :] < ctx[:, None]  # [nd, S]
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2).to(compute_dtype),                  # [nd, H, 1, D]
        k.permute(0, 2, 1, 3).to(compute_dtype),               # [nd, Hkv, S, D]
        v.permute(0, 2, 1, 3).to(compute_dtype),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa)
    out.copy_(o.squeeze(2).to(out.dtype))


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: :func:`reshape_and_cache` then :func:`paged_attention_ref`. Runs on CPU or GPU."""

    name = "torch"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        if query.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0]:
            raise ValueError(f"bad shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                             f"value {tuple(value.shape)}")
        if k_cache.dtype != key.dtype:
            raise ValueError(f"k_cache dtype {k_cache.dtype} != key dtype {key.dtype}")
        reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_ref(query, k_cache, v_cache, meta, scale)
