"""The CPU paged-attention kernel is batch-invariant (kernels/csrc/attention.cpp, attention_lanes.hpp): a query row's
output is bit for bit the same whether its prompt is attended whole, in chunks of any size, or as decodes one token
at a time, beside other sequences or alone, on one thread or two, with its context's splits run as separate items or
in turn; for every KV cache dtype, with sliding windows, soft-capping and sinks. And it stays close to float64."""
from __future__ import annotations

import contextlib

import pytest
import torch

from pagedserve.attention.cpu import cpu_decode_kernel_available
from support import kernel_switch

pytestmark = pytest.mark.skipif(not cpu_decode_kernel_available(), reason="CPU kernels unavailable")

H, HKV, D, BS = 9, 3, 64, 16
CTX = 600


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture(scope="module")
def context():
    """A 600-token context in scattered blocks: (k_cache, v_cache as float32, block table [1, blocks], q [600, H, D])."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-CTX // BS)
    caches = [torch.randn(blocks + 7, BS, HKV, D, generator=gen) for _ in range(2)]
    table = torch.randperm(blocks + 7, generator=gen)[:blocks].to(torch.int32)[None]
    return caches[0], caches[1], table, torch.randn(CTX, H, D, generator=gen)


def _prefill(q, k, v, table, start, end, **kw):
    """Rows [start, end) of the prompt as one chunk (the context then holds ``end`` tokens)."""
    return torch.ops.pagedserve_cpu.paged_attention(q[start:end].contiguous(), k, v, table, _i32(0, end - start),
                                                    _i32(end), 0.125, kw.get("window", 0), kw.get("softcap", 0.0),
                                                    kw.get("sinks"))


def _decode(q, k, v, table, pos, max_splits=0, **kw):
    return torch.ops.pagedserve_cpu.paged_decode_attention(q[pos:pos + 1].contiguous(), k, v, table, _i32(pos + 1),
                                                           0.125, max_splits, kw.get("window", 0),
                                                           kw.get("softcap", 0.0), kw.get("sinks"))


def _float64(q, k, v, table, window=0):
    keys = k[table[0].long()].reshape(-1, HKV, D)[:CTX].double().repeat_interleave(H // HKV, 1)
    vals = v[table[0].long()].reshape(-1, HKV, D)[:CTX].double().repeat_interleave(H // HKV, 1)
    s = torch.einsum("thd,jhd->htj", q.double(), keys) * 0.125
    pos = torch.arange(CTX)
    seen = (pos[None, :] <= pos[:, None]) & ((pos[:, None] - pos[None, :] < window) if window else True)
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("htj,jhd->thd", p, vals)


VARIANTS = [dict(), dict(window=40), dict(window=300), dict(softcap=2.0), dict(sinks="random")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_whole_chunked_and_decoded_rows_are_identical(context, dtype, variant):
    k, v, table, q = context
    k, v = k.to(dtype), v.to(dtype)
    kw = dict(VARIANTS[variant])
    if kw.get("sinks") == "random":
        kw["sinks"] = torch.randn(H, generator=torch.Generator().manual_seed(1)) * 2
    whole = _prefill(q, k, v, table, 0, CTX, **kw)
    for chunk in (16, 64, 512):
        pieces = [_prefill(q, k, v, table, a, min(CTX, a + chunk), **kw) for a in range(0, CTX, chunk)]
        assert torch.equal(torch.cat(pieces), whole), f"chunks of {chunk}"
    for pos in (0, 15, 16, 255, 256, 511, CTX - 1):   # decode rows: at, before and after block and split edges
        assert torch.equal(_decode(q, k, v, table, pos, **kw)[0], whole[pos]), f"decode at {pos}"
        assert torch.equal(_decode(q, k, v, table, pos, max_splits=1, **kw)[0], whole[pos])


def test_rows_beside_other_sequences_and_threads(context):
    """The prompt's last 100 rows beside two other sequences (a decode and a chunk, sharing blocks), in either order,
    on 1 and 2 threads: the same as alone."""
    k, v, table, q = context
    alone = _prefill(q, k, v, table, CTX - 100, CTX)
    gen = torch.Generator().manual_seed(2)
    other = torch.randn(1 + 30, H, D, generator=gen)
    tables = torch.cat([table.flip(1), table, table], 0)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = torch.ops.pagedserve_cpu.paged_attention(
                torch.cat([other[:1], other[1:], q[CTX - 100:]]), k, v, tables, _i32(0, 1, 31, 131), _i32(77, 300, CTX),
                0.125)
            assert torch.equal(got[31:], alone)
            got = torch.ops.pagedserve_cpu.paged_attention(
                torch.cat([q[CTX - 100:], other[1:]]), k, v, tables[1:], _i32(0, 100, 130), _i32(CTX, 300), 0.125)
            assert torch.equal(got[:100], alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [0, 100])
def test_close_to_float64(context, window):
    k, v, table, q = context
    got = _prefill(q, k, v, table, 0, CTX, window=window)
    assert (got.double() - _float64(q, k, v, table, window)).abs().max().item() < 2e-6


def test_padding_rows_are_zero_and_bad_starts_refused(context):
    k, v, table, q = context
    out = torch.ops.pagedserve_cpu.paged_attention(q[:8].contiguous(), k, v, table, _i32(0, 5), _i32(5), 0.125)
    assert torch.equal(out[5:], torch.zeros(3, H, D)) and torch.equal(out[:5], _prefill(q, k, v, table, 0, 5))
    with pytest.raises(RuntimeError, match="query_len"):
        torch.ops.pagedserve_cpu.paged_attention(q[:8].contiguous(), k, v, table, _i32(0, 8), _i32(5), 0.125)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        torch.ops.pagedserve_cpu.paged_attention(q[:8].contiguous(), k, v, table, _i32(1, 8), _i32(8), 0.125)


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """Each test on the AVX-512 code (16 lanes for prefill tiles; skipped where the CPU lacks AVX-512) and on the AVX2
    code (8 lanes: what every x86-64 CPU with AVX2 runs)."""
    yield from kernel_switch(torch.ops.pagedserve_cpu.paged_attention_avx512, request.param == "avx512", "AVX-512")


# (query heads, KV heads, head_dim): query heads per KV head 1, 3, 4, 7, 8 and 10 (a decode's lanes in two tiles),
# head dims that are and are not a multiple of the value chunk
SHAPES = [(4, 4, 64), (9, 3, 64), (8, 2, 128), (14, 2, 80), (16, 2, 64), (20, 2, 48)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_equal_prefill_rows_for_every_head_grouping(isa, shape, dtype):
    """A decode row (keys in the vector lanes, rows copied) gives the bits of the same row in a prefill chunk (heads
    in the lanes), for every query-heads-per-KV-head grouping and head dim, alone and among other decodes."""
    h, hkv, d = shape
    ctx = 300
    gen = torch.Generator().manual_seed(5)
    blocks = -(-ctx // BS)
    k, v = (torch.randn(blocks + 3, BS, hkv, d, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].to(torch.int32)[None]
    q = torch.randn(ctx, h, d, generator=gen)
    whole = torch.ops.pagedserve_cpu.paged_attention(q, k, v, table, _i32(0, ctx), _i32(ctx), 0.125)
    positions = (0, 7, 8, 255, 256, ctx - 1)
    rows = torch.ops.pagedserve_cpu.paged_decode_attention(
        q[list(positions)].contiguous(), k, v, table.expand(len(positions), -1).contiguous(),
        _i32(*(p + 1 for p in positions)), 0.125)
    for i, pos in enumerate(positions):
        assert torch.equal(rows[i], whole[pos]), f"decode at {pos} among others"
        alone = torch.ops.pagedserve_cpu.paged_decode_attention(q[pos:pos + 1].contiguous(), k, v, table,
                                                                _i32(pos + 1), 0.125)
        assert torch.equal(alone[0], whole[pos]), f"decode at {pos} alone"


def test_avx2_code_gives_the_avx512_codes_values(context):
    """Where the CPU has AVX-512, its 16-lane code and the AVX2 code give the same bits (prefill chunks and decodes)."""
    switch = torch.ops.pagedserve_cpu.paged_attention_avx512
    k, v, table, q = context
    calls = [lambda: _prefill(q, k, v, table, 0, CTX), lambda: _prefill(q, k, v, table, 500, CTX, window=40),
             lambda: _decode(q, k, v, table, CTX - 1), lambda: _decode(q, k, v, table, 300, softcap=2.0)]
    runs = {}
    for on in (True, False):
        with contextlib.contextmanager(kernel_switch)(switch, on, "AVX-512"):
            assert torch.ops.pagedserve_cpu.paged_attention_lanes() == (16 if on else 8)
            runs[on] = [call() for call in calls]
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))
