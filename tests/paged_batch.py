"""Random paged-attention batches for the GPU tests: caches, block tables with scattered physical blocks, and the
step's :class:`AttentionMetadata` (decodes first, as the model runner orders them)."""
from __future__ import annotations

import random

import torch

from pagedserve.attention.base import AttentionMetadata

# (atol, rtol) of a kernel's output against the fp32-softmax torch reference, per storage dtype.
ATTN_TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_needed(context_lens: list[int], block_size: int) -> int:
    return sum(cdiv(c, block_size) for c in context_lens)


def make_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` of standard-normal values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=gen, device=device).to(dtype),
            torch.randn(shape, generator=gen, device=device).to(dtype))


def make_meta(context_lens: list[int], query_lens: list[int], block_size: int, num_blocks: int, device,
              seed: int) -> AttentionMetadata:
    """Metadata for sequences with these context and new-token counts; each sequence gets distinct, randomly
    scattered physical blocks, and table padding points at the last block (valid memory, never meant to be read)."""
    assert all(1 <= q <= c for q, c in zip(query_lens, context_lens))
    rng = random.Random(seed)
    need = [cdiv(c, block_size) for c in context_lens]
    assert sum(need) <= num_blocks, "cache too small for the batch"
    physical = rng.sample(range(num_blocks), sum(need))
    width = max(need)
    rows, slots, starts, offset = [], [], [0], 0
    for ctx, q_len, n in zip(context_lens, query_lens, need):
        ids = physical[offset:offset + n]
        offset += n
        rows.append(ids + [num_blocks - 1] * (width - n))
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
        starts.append(starts[-1] + q_len)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(rows, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens), max_context_len=max(context_lens), num_decode_seqs=num_decodes,
        query_lens_cpu=list(query_lens), context_lens_cpu=list(context_lens))


def random_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query/key/value as strided views of one fused projection ``[T, (H + 2 Hkv) * D]``, as the model makes them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))
