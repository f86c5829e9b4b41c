"""Checks of each CUDA kernel against its torch reference (attention/torch_ref.py, elementwise_ref.py), shared by
the GPU tests (tests/kernel_tests/gpu/test_kernels_gpu.py, large shapes on a real device) and the host-emulator tests
(tests/kernel_tests/test_kernels_simt.py, small shapes on CPU tensors). Each function takes the device and the shapes."""
from __future__ import annotations

import random

import torch

from pagedserve import kernels
from pagedserve.kernels import elementwise_ref as ops
from pagedserve.kernels import geometry as geo
from pagedserve.attention import torch_ref
from paged_batch import ATTN_TOL, blocks_needed, make_caches, make_meta, random_qkv

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# The GPU tests' grid. Decode (context lengths, num_heads, num_kv_heads): batch 1..256, ragged contexts 1..16k,
# GQA ratios 1, 3, 4, 8, 16. Prefill (cached prefix, new tokens) per sequence: block-aligned, unaligned, long
# (15000), none (1000 new tokens), and a one-token chunk that is not a decode (it follows prefills); block_size is
# filled in.
GPU_DECODE_CASES = [
    ([1], 8, 8),
    ([random.Random(1).randint(1, 300) for _ in range(256)], 32, 4),
    ([1, 17, 513, 4097, 16384], 16, 4),
    ([random.Random(2).randint(1, 2048) for _ in range(64)], 8, 1),
    ([77, 1000, 3], 9, 3),
    ([5000, 31], 32, 2),
]


def gpu_prefill_case(block_size: int) -> dict:
    return dict(prefix=[2 * block_size, 333, 15000, 5, 90, 0, 40], new=[200, 5, 130, 64, 63, 1000, 1])
# (atol, rtol) of the elementwise kernels against kernels/elementwise_ref.py, per dtype.
ELEM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def assert_attention_close(out, ref, dtype):
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def head_sinks(heads: int, device, seed: int = 5) -> torch.Tensor:
    """Random per-head sink logits (gpt-oss's attention sinks), about the scores' size, float32."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


def check_decode(device, dtype, head_dim, block_size, cases, max_seqs_256: int | None = None, window=None,
                 softcap=None, sinks=False):
    """``cases``: (context lengths, num_heads, num_kv_heads). Query rows are strided views of a fused QKV
    projection, the output starts as NaN, block tables scatter each sequence over random physical blocks. With a
    ``window``, the block-table entries before each context's window read (outside the blocks it may touch) point
    far outside the cache, so a kernel that read one would fault (on the emulator: stop). ``softcap``: the scores'
    soft-cap; ``sinks``: random per-head sink logits (:func:`head_sinks`)."""
    for i, (ctx, heads, kv_heads) in enumerate(cases):
        if head_dim == 256 and max_seqs_256 is not None:
            ctx = ctx[:max_seqs_256]  # bounds the reference's dense gather
        num_blocks = blocks_needed(ctx, block_size) + 3
        k_cache, v_cache = make_caches(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=i)
        meta = make_meta(ctx, [1] * len(ctx), block_size, num_blocks, device, seed=i)
        query, _, _ = random_qkv(len(ctx), heads, kv_heads, head_dim, dtype, device, seed=100 + i)
        scale = head_dim ** -0.5
        out = torch.full_like(query, float("nan"))
        tables = meta.block_tables
        if window:
            tables = tables.clone()
            for s, c in enumerate(ctx):
                tables[s, :(c - geo.window_read_len(c, window, block_size)) // block_size] = 1 << 30
        sink = head_sinks(heads, device) if sinks else None
        kernels.paged_decode_attention(out, query, k_cache, v_cache, tables, meta.context_lens, scale,
                                       context_lens_cpu=ctx, sliding_window=window, softcap=softcap, sinks=sink)
        ref = torch_ref.paged_attention_ref(query, k_cache, v_cache, meta, scale, sliding_window=window,
                                            softcap=softcap, sinks=sink)
        assert_attention_close(out, ref, dtype)


def decode_once(query, k_cache, v_cache, tables, context_lens, scale, plan=None, **kw):
    """One paged_decode_attention launch into a NaN-filled output (``plan`` None: the launcher's own plan from the
    host context lengths); returns the output."""
    out = torch.full_like(query, float("nan"))
    host = None if plan is not None else context_lens.tolist()
    kernels.paged_decode_attention(out, query, k_cache, v_cache, tables, context_lens, scale,
                                   context_lens_cpu=host, plan=plan, **kw)
    return out


def check_decode_partitions(device, dtype, ctx, heads, kv_heads, head_dim, block_size, window=None, softcap=None,
                            sinks=False, capacity=None):
    """A batch whose contexts read one or several of the fixed 256-key split-K partitions (merged in order) equals
    the reference, and each sequence's output is the same bits alone as in the batch, and in the fixed grid of a
    CUDA graph of ``capacity`` tokens (default: twice the longest context) with every sequence. Returns the batch's
    plan."""
    num_blocks = blocks_needed(ctx, block_size) + 1
    k_cache, v_cache = make_caches(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=7)
    meta = make_meta(ctx, [1] * len(ctx), block_size, num_blocks, device, seed=7)
    query = torch.randn(len(ctx), heads, head_dim, device=device).to(dtype)
    sink = head_sinks(heads, device) if sinks else None
    kw = dict(sliding_window=window, softcap=softcap, sinks=sink)
    ref = torch_ref.paged_attention_ref(query, k_cache, v_cache, meta, 0.1, **kw)
    name = geo.dtype_name(dtype)
    plan = geo.plan_decode(name, ctx, heads, kv_heads, head_dim, block_size, sliding_window=window or 0)
    tables, lens = meta.block_tables, meta.context_lens
    batch = decode_once(query, k_cache, v_cache, tables, lens, 0.1, plan=plan, **kw)
    assert_attention_close(batch, ref, dtype)
    fixed = geo.plan_decode_fixed(name, len(ctx), capacity or 2 * max(ctx), heads, kv_heads, head_dim, block_size,
                                  sliding_window=window or 0)
    assert_same_bits(decode_once(query, k_cache, v_cache, tables, lens, 0.1, plan=fixed, **kw), batch, "fixed grid")
    for i in range(len(ctx)):
        alone = decode_once(query[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], 0.1, **kw)
        assert_same_bits(alone, batch[i:i + 1], f"sequence {i} (context {ctx[i]}) alone")
    return plan


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-identical (NaN where NaN, the same sign of zero): a batch-invariance check, not a tolerance."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    same = got.view(torch.int16 if got.element_size() == 2 else torch.int32) == \
        want.view(torch.int16 if want.element_size() == 2 else torch.int32)
    if not bool(same.all()):
        diff = (got.float() - want.float()).abs().max().item()
        raise AssertionError(f"{what}: {int((~same).sum())} of {same.numel()} elements differ (max |diff| {diff:.3g})")


def check_decode_fixed(device, dtype, head_dim, block_size, ctx, heads, kv_heads, capacity, num_padded,
                       window=None):
    """The CUDA-graph decode launch: the fixed grid of plan_decode_fixed (from the batch size and ``capacity``
    tokens only) over sequences of context ``ctx`` followed by ``num_padded`` padded rows (context 0), with a
    static block table ``capacity / block_size`` wide whose unused entries (past each context, and every padded
    row) hold a block id far outside the cache, so a kernel that read one would fault (on the emulator: stop).
    Real rows equal the reference and, bit for bit, an eager launch of theirs; padded rows are zeros. Returns the
    plan."""
    n, total = len(ctx), len(ctx) + num_padded
    num_blocks = blocks_needed(ctx, block_size) + 2
    k_cache, v_cache = make_caches(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=11)
    meta = make_meta(ctx, [1] * n, block_size, num_blocks, device, seed=11)
    width = -(-capacity // block_size)
    tables = torch.full((total, width), 1 << 30, dtype=torch.int32, device=device)
    for i, c in enumerate(ctx):
        used = -(-c // block_size)
        tables[i, :used] = meta.block_tables[i, :used]
    context_lens = torch.tensor(list(ctx) + [0] * num_padded, dtype=torch.int32, device=device)
    query = torch.randn(total, heads, head_dim, device=device).to(dtype)
    plan = geo.plan_decode_fixed(geo.dtype_name(dtype), total, capacity, heads, kv_heads, head_dim, block_size,
                                 sliding_window=window or 0)
    out = torch.full_like(query, float("nan"))
    scale = head_dim ** -0.5
    kernels.paged_decode_attention(out, query, k_cache, v_cache, tables, context_lens, scale, plan=plan,
                                   sliding_window=window)
    ref = torch_ref.paged_attention_ref(query[:n], k_cache, v_cache, meta, scale, sliding_window=window)
    assert_attention_close(out[:n], ref, dtype)
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padded rows (context 0) must be zeros"
    eager = decode_once(query[:n], k_cache, v_cache, tables[:n], context_lens[:n], scale, sliding_window=window)
    assert_same_bits(out[:n], eager, "fixed grid vs the eager plan")  # the capacity sets the grid, not the values
    return plan


def check_prefill(device, dtype, head_dim, block_size, prefix, new, decode_ctx=(3000, 1), heads_kv=None,
                  window=None, softcap=None, sinks=False):
    """Decodes first (``decode_ctx``), then prefill chunks of ``new`` tokens after cached prefixes of ``prefix``
    tokens, under a sliding ``window`` or none (``softcap``, ``sinks``: as for :func:`check_decode`); the decode
    rows of ``out`` must stay untouched."""
    ctx = list(decode_ctx) + [p + n for p, n in zip(prefix, new)]
    q_lens = [1] * len(decode_ctx) + list(new)
    heads, kv_heads = heads_kv or ((8, 2) if head_dim == 256 else (12, 4))
    num_blocks = blocks_needed(ctx, block_size) + 2
    k_cache, v_cache = make_caches(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=head_dim)
    meta = make_meta(ctx, q_lens, block_size, num_blocks, device, seed=block_size)
    query, _, _ = random_qkv(sum(q_lens), heads, kv_heads, head_dim, dtype, device, seed=3)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    nd = meta.num_decode_seqs
    sink = head_sinks(heads, device) if sinks else None
    kernels.paged_prefill_attention(out, query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                    meta.query_start_loc, scale, seq_offset=nd, num_prefill_seqs=len(ctx) - nd,
                                    max_query_len=meta.max_query_len, sliding_window=window, softcap=softcap,
                                    sinks=sink)
    ref = torch_ref.paged_attention_ref(query, k_cache, v_cache, meta, scale, sliding_window=window,
                                        softcap=softcap, sinks=sink)
    assert torch.isnan(out[:nd]).all(), "decode rows are not the prefill kernel's to write"
    assert_attention_close(out[nd:], ref[nd:], dtype)


def check_reshape_and_cache(device, dtype):
    heads, kv_heads, head_dim, bs, num_blocks = 8, 2, 128, 16, 40
    key = random_qkv(50, heads, kv_heads, head_dim, dtype, device, seed=1)[1]
    value = random_qkv(50, heads, kv_heads, head_dim, dtype, device, seed=2)[2]
    slots = torch.randperm(num_blocks * bs, device=device)[:50]
    slots[::7] = -1  # padding rows are skipped
    k_ref, v_ref = make_caches(num_blocks, bs, kv_heads, head_dim, dtype, device, seed=3)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    torch_ref.reshape_and_cache(key, value, k_ref, v_ref, slots)
    kernels.reshape_and_cache(key, value, k_out, v_out, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    # a contiguous key whose rows are not 16-byte multiples falls back to narrower copies
    odd = torch.randn(50, 1, 66, device=device)[..., :64].to(dtype)
    k2 = torch.zeros(4, 16, 1, 64, dtype=dtype, device=device)
    v2 = torch.zeros(4, 16, 1, 64, dtype=dtype, device=device)
    kernels.reshape_and_cache(odd, odd, k2, v2, torch.arange(50, device=device) + 3)
    assert torch.equal(k2.view(64, 64)[3:53], odd[:, 0]) and torch.equal(v2.view(64, 64)[3:53], odd[:, 0])


def check_copy_blocks(device):
    caches = [make_caches(20, 16, 4, 64, torch.bfloat16, device, seed=i) for i in range(3)]
    ks, vs = [c[0] for c in caches], [c[1] for c in caches]
    mapping = torch.tensor([[0, 5], [7, 1], [19, 2]], dtype=torch.int64, device=device)
    expect_k = [k.clone() for k in ks]
    expect_v = [v.clone() for v in vs]
    for src, dst in mapping.tolist():
        for k, v in zip(expect_k, expect_v):
            k[dst], v[dst] = k[src], v[src]
    kernels.copy_blocks(ks, vs, mapping)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, expect_k + expect_v))


def check_rms_norm(device, dtype, hidden, rows=37):
    x = torch.randn(rows, hidden, device=device).to(dtype)
    residual = torch.randn(rows, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    atol, rtol = ELEM_TOL[dtype]
    for res in (None, residual):
        normed, new_res = kernels.rms_norm(x, weight, 1e-6, res)
        ref_normed, ref_res = ops.rms_norm(x, weight, 1e-6, res)
        torch.testing.assert_close(normed, ref_normed, atol=atol, rtol=rtol)
        assert torch.equal(new_res, ref_res)


def check_rotary(device, dtype, head_dim, is_neox, tokens=33):
    table = ops.rotary_cos_sin_cache(head_dim, 4096, 10000.0, device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q, k, _ = random_qkv(tokens, 8, 2, head_dim, dtype, device, seed=5)  # strided views, as in the model
    atol, rtol = ELEM_TOL[dtype]
    for x in (q, k):
        torch.testing.assert_close(kernels.rotary_embedding(positions, x, table, is_neox),
                                   ops.rotary_embedding(positions, x, table, is_neox), atol=atol, rtol=rtol)


def check_silu_and_mul(device, dtype, shape):
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    atol, rtol = ELEM_TOL[dtype]
    torch.testing.assert_close(kernels.silu_and_mul(x), ops.silu_and_mul(x), atol=atol, rtol=rtol)


def planted(old: str, new: str):
    """A source transform (``Simulator(transform=...)``) that plants a bug: ``old`` replaced by ``new`` once."""
    def transform(source: str) -> str:
        if old not in source:  # not an AssertionError: the test must not pass because the bug was not planted
            raise ValueError(f"{old!r} not in the kernel source")
        return source.replace(old, new, 1)
    return transform
