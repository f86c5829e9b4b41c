"""Each CUDA kernel against its torch reference (attention/torch_ref.py, ops.py) over a grid of shapes, dtypes,
head dims, block sizes and GQA ratios. Sized to run in about a minute on an H200 (NVRTC compiles included)."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve import kernel_geometry as geo
from pagedserve import kernels, ops
from pagedserve.attention import torch_ref
from paged_batch import ATTN_TOL, blocks_needed, make_caches, make_meta, random_qkv

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cupy")

DEV = torch.device("cuda")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (context lengths, num_heads, num_kv_heads): batch 1..256, ragged contexts 1..16k, GQA ratios 1, 3, 4, 8, 16.
DECODE_CASES = [
    ([1], 8, 8),
    ([random.Random(1).randint(1, 300) for _ in range(256)], 32, 4),
    ([1, 17, 513, 4097, 16384], 16, 4),
    ([random.Random(2).randint(1, 2048) for _ in range(64)], 8, 1),
    ([77, 1000, 3], 9, 3),
    ([5000, 31], 32, 2),
]


def assert_attention_close(out, ref, dtype):
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def decode_ref(query, k_cache, v_cache, meta, scale):
    return torch_ref.paged_attention_ref(query, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype, head_dim, block_size):
    for i, (ctx, heads, kv_heads) in enumerate(DECODE_CASES):
        if head_dim == 256 and len(ctx) > 64:
            ctx = ctx[:64]  # bounds the reference's dense gather
        num_blocks = blocks_needed(ctx, block_size) + 3
        k_cache, v_cache = make_caches(num_blocks, block_size, kv_heads, head_dim, dtype, DEV, seed=i)
        meta = make_meta(ctx, [1] * len(ctx), block_size, num_blocks, DEV, seed=i)
        query, _, _ = random_qkv(len(ctx), heads, kv_heads, head_dim, dtype, DEV, seed=100 + i)  # strided rows
        scale = head_dim ** -0.5
        out = torch.full_like(query, float("nan"))
        kernels.paged_decode_attention(out, query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                       context_lens_cpu=ctx)
        assert_attention_close(out, decode_ref(query, k_cache, v_cache, meta, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_split_and_single_partition_agree(dtype):
    """The same batch through a forced 64-token split-K plan, the automatic plan and one partition."""
    ctx, heads, kv_heads, head_dim, bs = [1, 63, 64, 65, 1500, 3001], 16, 2, 128, 16
    num_blocks = blocks_needed(ctx, bs) + 1
    k_cache, v_cache = make_caches(num_blocks, bs, kv_heads, head_dim, dtype, DEV, seed=7)
    meta = make_meta(ctx, [1] * len(ctx), bs, num_blocks, DEV, seed=7)
    query = torch.randn(len(ctx), heads, head_dim, device=DEV).to(dtype)
    ref = decode_ref(query, k_cache, v_cache, meta, 0.1)
    name = geo.dtype_name(dtype)
    auto = geo.plan_decode(name, ctx, heads, kv_heads, head_dim, bs, num_sms=132)
    assert auto.num_partitions > 1
    for size in (64, auto.partition_size, 3008):
        plan = geo.plan_decode(name, ctx, heads, kv_heads, head_dim, bs, num_sms=132, partition_size=size)
        out = torch.empty_like(query)
        kernels.paged_decode_attention(out, query, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.1,
                                       plan=plan)
        assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(dtype, head_dim, block_size):
    """Two decodes, then prefill chunks after cached prefixes: block-aligned, unaligned, long (15000), none
    (1000 new tokens), and a one-token chunk that is not a decode (it follows prefills)."""
    prefix = [2 * block_size, 333, 15000, 5, 90, 0, 40]
    new = [200, 5, 130, 64, 63, 1000, 1]
    ctx = [3000, 1] + [p + n for p, n in zip(prefix, new)]
    q_lens = [1, 1] + new
    heads, kv_heads = (8, 2) if head_dim == 256 else (12, 4)
    num_blocks = blocks_needed(ctx, block_size) + 2
    k_cache, v_cache = make_caches(num_blocks, block_size, kv_heads, head_dim, dtype, DEV, seed=head_dim)
    meta = make_meta(ctx, q_lens, block_size, num_blocks, DEV, seed=block_size)
    query, _, _ = random_qkv(sum(q_lens), heads, kv_heads, head_dim, dtype, DEV, seed=3)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    nd = meta.num_decode_seqs
    kernels.paged_prefill_attention(out, query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                    meta.query_start_loc, scale, seq_offset=nd, num_prefill_seqs=len(ctx) - nd,
                                    max_query_len=meta.max_query_len)
    ref = torch_ref.paged_attention_ref(query, k_cache, v_cache, meta, scale)
    assert torch.isnan(out[:nd]).all(), "decode rows are not the prefill kernel's to write"
    assert_attention_close(out[nd:], ref[nd:], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_is_exact(dtype):
    heads, kv_heads, head_dim, bs, num_blocks = 8, 2, 128, 16, 40
    key = random_qkv(50, heads, kv_heads, head_dim, dtype, DEV, seed=1)[1]
    value = random_qkv(50, heads, kv_heads, head_dim, dtype, DEV, seed=2)[2]
    slots = torch.randperm(num_blocks * bs, device=DEV)[:50]
    slots[::7] = -1  # padding rows are skipped
    k_ref, v_ref = make_caches(num_blocks, bs, kv_heads, head_dim, dtype, DEV, seed=3)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    torch_ref.reshape_and_cache(key, value, k_ref, v_ref, slots)
    kernels.reshape_and_cache(key, value, k_out, v_out, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    # a contiguous key whose rows are not 16-byte multiples falls back to narrower copies
    odd = torch.randn(50, 1, 66, device=DEV)[..., :64].to(dtype)
    k2, v2 = torch.zeros(4, 16, 1, 64, dtype=dtype, device=DEV), torch.zeros(4, 16, 1, 64, dtype=dtype, device=DEV)
    kernels.reshape_and_cache(odd, odd, k2, v2, torch.arange(50, device=DEV) + 3)
    assert torch.equal(k2.view(64, 64)[3:53], odd[:, 0]) and torch.equal(v2.view(64, 64)[3:53], odd[:, 0])


def test_copy_blocks_is_exact():
    caches = [make_caches(20, 16, 4, 64, torch.bfloat16, DEV, seed=i) for i in range(3)]
    ks, vs = [c[0] for c in caches], [c[1] for c in caches]
    mapping = torch.tensor([[0, 5], [7, 1], [19, 2]], dtype=torch.int64, device=DEV)
    expect_k = [k.clone() for k in ks]
    expect_v = [v.clone() for v in vs]
    for src, dst in mapping.tolist():
        for k, v in zip(expect_k, expect_v):
            k[dst], v[dst] = k[src], v[src]
    kernels.copy_blocks(ks, vs, mapping)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, expect_k + expect_v))


ELEM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


@pytest.mark.parametrize("hidden", [576, 4096, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype, hidden):
    x = torch.randn(37, hidden, device=DEV).to(dtype)
    residual = torch.randn(37, hidden, device=DEV).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    atol, rtol = ELEM_TOL[dtype]
    for res in (None, residual):
        normed, new_res = kernels.rms_norm(x, weight, 1e-6, res)
        ref_normed, ref_res = ops.rms_norm(x, weight, 1e-6, res)
        torch.testing.assert_close(normed, ref_normed, atol=atol, rtol=rtol)
        assert torch.equal(new_res, ref_res)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding(dtype, head_dim, is_neox):
    table = ops.rotary_cos_sin_cache(head_dim, 4096, 10000.0, DEV)
    positions = torch.randint(0, 4096, (33,), device=DEV)
    q, k, _ = random_qkv(33, 8, 2, head_dim, dtype, DEV, seed=5)  # strided views, as in the model
    atol, rtol = ELEM_TOL[dtype]
    for x in (q, k):
        torch.testing.assert_close(kernels.rotary_embedding(positions, x, table, is_neox),
                                   ops.rotary_embedding(positions, x, table, is_neox), atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(37, 2 * 1536), (5, 2 * 7), (2, 3, 2 * 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype, shape):
    x = (3 * torch.randn(shape, device=DEV)).to(dtype)
    atol, rtol = ELEM_TOL[dtype]
    torch.testing.assert_close(kernels.silu_and_mul(x), ops.silu_and_mul(x), atol=atol, rtol=rtol)
