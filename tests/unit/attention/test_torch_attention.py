"""The torch reference attention (the CPU path and the CUDA kernels' oracle) against plain dense attention.

Covers the paths the CPU speed-ups added: decodes split into several context-length groups, gathered into reused
buffers with GQA folded into query rows; prefill chunks with a cached prefix (masked) and without (is_causal,
reading the new K/V rows directly).
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedserve.attention import torch_ref
from pagedserve.attention.base import AttentionMetadata


def dense_reference(q, k, v, scale, window=None, softcap=None, sinks=None):
    """Causal attention of ``q`` ``[Lq, H, D]`` over ``k``/``v`` ``[Lk, Hkv, D]``; the queries are the last Lq
    positions; with a ``window`` a query at position p sees keys p - window + 1 .. p only; ``softcap`` c maps each
    scaled score s to c tanh(s / c); ``sinks`` ``[H]`` adds one logit per head to the softmax, then dropped.
    float64."""
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    k = k.double().repeat_interleave(h // hkv, dim=1)
    v = v.double().repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos_q = torch.arange(lk - lq, lk)[:, None]
    keys = torch.arange(lk)[None, :]
    hidden = (keys > pos_q) | ((keys <= pos_q - window) if window else False)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(h, lq, 1)
        return torch.einsum("hqk,khd->qhd", torch.cat([scores, sink], -1).softmax(-1)[..., :lk], v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, num_blocks, seed):
    """A random paged cache holding each sequence's context, and the step's metadata / new rows."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    max_blocks = max((c + block_size - 1) // block_size for c in context_lens)
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    slots, contexts = [], []
    for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        nb = (cl + block_size - 1) // block_size
        blocks = [free.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cl - ql, cl)]
        contexts.append(torch.cat([k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:cl],
                                   v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:cl]], dim=1))
    t = sum(query_lens)
    query = torch.randn(t, num_heads, head_dim, generator=g)
    key = torch.randn(t, num_kv_heads, head_dim, generator=g)
    value = torch.randn(t, num_kv_heads, head_dim, generator=g)
    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)
    nd = 0
    while nd < len(query_lens) and query_lens[nd] == 1:
        nd += 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32), max_query_len=max(query_lens),
        max_context_len=max(context_lens), num_decode_seqs=nd, query_lens_cpu=list(query_lens),
        context_lens_cpu=list(context_lens))
    return k_cache, v_cache, meta, query, key, value, starts


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_backend_matches_dense_attention(num_heads, num_kv_heads):
    block_size, head_dim, scale = 16, 64, 64 ** -0.5
    decode_ctx = [900, 870, 640, 400, 333, 120, 64, 17, 5, 1]   # longest first, as the model runner orders them
    prefill = [(40, 40), (25, 200), (1 + 16, 1 + 16), (7, 300)]  # (new tokens, context): no prefix / cached prefix
    query_lens = [1] * len(decode_ctx) + [q for q, _ in prefill]
    context_lens = decode_ctx + [c for _, c in prefill]
    k_cache, v_cache, meta, query, key, value, starts = build_step(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, 256, seed=num_heads)
    plan = torch_ref.plan_step(meta, block_size)
    assert len(plan.decode_groups) > 1                        # the spread of lengths splits the decodes
    assert plan.prefill_masks[0] is None and plan.prefill_masks[1] is not None
    backend = torch_ref.TorchAttentionBackend()
    for _ in range(2):  # twice: the second run reuses the step plan and the gather buffers
        out = backend.forward(query, key, value, k_cache, v_cache, meta, scale)
        for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
            k = torch_ref.gather_kv(k_cache, meta.block_tables[i], cl)
            v = torch_ref.gather_kv(v_cache, meta.block_tables[i], cl)
            ref = dense_reference(query[starts[i]:starts[i] + ql], k, v, scale)
            torch.testing.assert_close(out[starts[i]:starts[i] + ql].double(), ref, atol=2e-5, rtol=1e-5)
    # Without a backend (the CUDA kernels' oracle form): same result.
    torch.testing.assert_close(torch_ref.paged_attention_ref(query, k_cache, v_cache, meta, scale), out)


@pytest.mark.parametrize("window", [1, 7, 64, 350, 5000])
def test_sliding_window_matches_dense_attention(window):
    """A sliding window (1 key, less than a block, a block's multiple, mid-context, wider than every context) on
    decodes in several groups and prefill chunks with and without a cached prefix, chunks starting past the window:
    each row equals dense attention over the keys of its window; the step's other layers (no window) are unchanged
    by the windowed layer's masks."""
    block_size, head_dim, scale = 16, 32, 32 ** -0.5
    decode_ctx = [900, 870, 400, 120, 64, 17, 1]
    prefill = [(40, 40), (25, 200), (30, 30 + 700), (400, 400)]
    query_lens = [1] * len(decode_ctx) + [q for q, _ in prefill]
    context_lens = decode_ctx + [c for _, c in prefill]
    k_cache, v_cache, meta, query, key, value, starts = build_step(
        query_lens, context_lens, 8, 2, head_dim, block_size, 400, seed=window)
    backend = torch_ref.TorchAttentionBackend()
    full = backend.forward(query, key, value, k_cache, v_cache, meta, scale)
    out = backend.forward(query, key, value, k_cache, v_cache, meta, scale, window)
    again = backend.forward(query, key, value, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(again, full, atol=0, rtol=0)
    for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        k = torch_ref.gather_kv(k_cache, meta.block_tables[i], cl)
        v = torch_ref.gather_kv(v_cache, meta.block_tables[i], cl)
        ref = dense_reference(query[starts[i]:starts[i] + ql], k, v, scale, window)
        torch.testing.assert_close(out[starts[i]:starts[i] + ql].double(), ref, atol=2e-5, rtol=1e-5)
    if window >= max(context_lens):
        torch.testing.assert_close(out, full, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="sliding_window"):
        backend.forward(query, key, value, k_cache, v_cache, meta, scale, 0)


def test_decode_groups_cover_every_row_once_in_any_order():
    lens = [3, 700, 20, 700, 1, 64, 5000, 2]  # not sorted: still correct, only less tightly grouped
    _, _, meta, *_ = build_step([1] * len(lens), lens, 2, 1, 16, 16, 600, seed=0)
    groups = torch_ref.plan_step(meta, 16).decode_groups
    assert [(g.start, g.end) for g in groups] == sorted((g.start, g.end) for g in groups)
    assert groups[0].start == 0 and groups[-1].end == len(lens)
    assert all(a.end == b.start for a, b in zip(groups, groups[1:]))
    for g in groups:
        longest = max(lens[g.start:g.end])
        assert g.tables.numel() == (g.end - g.start) * ((longest + 15) // 16)
        assert g.mask.shape[-1] >= longest


def test_bfloat16_on_cpu_runs_the_flash_kernel_within_bf16_tolerance():
    """CPU bf16 inputs go to SDPA as bf16 (the CPU flash kernel accumulates in fp32), not upcast copies."""
    decode_ctx, prefill = [300, 40, 3], [(30, 30), (12, 90)]
    query_lens = [1] * len(decode_ctx) + [q for q, _ in prefill]
    context_lens = decode_ctx + [c for _, c in prefill]
    k_cache, v_cache, meta, query, key, value, starts = build_step(query_lens, context_lens, 9, 3, 64, 16, 64, seed=5)
    out = torch_ref.TorchAttentionBackend().forward(query.bfloat16(), key.bfloat16(), value.bfloat16(),
                                                    k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.125)
    assert out.dtype == torch.bfloat16
    key_b, value_b = key.bfloat16().float(), value.bfloat16().float()
    for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        k = torch_ref.gather_kv(k_cache.bfloat16().float(), meta.block_tables[i], cl)
        v = torch_ref.gather_kv(v_cache.bfloat16().float(), meta.block_tables[i], cl)
        k[cl - ql:], v[cl - ql:] = key_b[starts[i]:starts[i] + ql], value_b[starts[i]:starts[i] + ql]
        ref = dense_reference(query[starts[i]:starts[i] + ql].bfloat16().float(), k, v, 0.125)
        torch.testing.assert_close(out[starts[i]:starts[i] + ql].double(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 7, 350])
def test_softcap_and_sinks_match_dense_attention(window, monkeypatch):
    """Soft-capped scores and sink logits (the float32 math path) on decodes in several groups and prefill chunks
    with and without a cached prefix, scored a few query rows at a time: each row equals dense attention."""
    monkeypatch.setattr(torch_ref, "MATH_QUERY_ROWS", 16)   # several row blocks per chunk
    block_size, head_dim, scale = 16, 32, 32 ** -0.5
    decode_ctx = [900, 400, 120, 17, 1]
    prefill = [(40, 40), (25, 200), (30, 30 + 700)]
    query_lens = [1] * len(decode_ctx) + [q for q, _ in prefill]
    context_lens = decode_ctx + [c for _, c in prefill]
    k_cache, v_cache, meta, query, key, value, starts = build_step(
        query_lens, context_lens, 8, 2, head_dim, block_size, 400, seed=3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)) * 2
    backend = torch_ref.TorchAttentionBackend()
    for softcap, sink in ((2.0, None), (None, sinks), (1.0, sinks)):
        out = backend.forward(query, key, value, k_cache, v_cache, meta, scale, window, softcap=softcap, sinks=sink)
        for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
            k = torch_ref.gather_kv(k_cache, meta.block_tables[i], cl)
            v = torch_ref.gather_kv(v_cache, meta.block_tables[i], cl)
            ref = dense_reference(query[starts[i]:starts[i] + ql], k, v, scale, window, softcap, sink)
            torch.testing.assert_close(out[starts[i]:starts[i] + ql].double(), ref, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        backend.forward(query, key, value, k_cache, v_cache, meta, scale, softcap=0.0)
    with pytest.raises(ValueError, match="sinks"):
        backend.forward(query, key, value, k_cache, v_cache, meta, scale, sinks=torch.zeros(3))


def test_opaque_op_passes_the_layer_window():
    """The compiled forward's attention op (attention/opaque.py) runs the backend with the layer's window (0: none)
    and zeroes the padded rows past the step's tokens."""
    from pagedserve.attention.opaque import step_context

    k_cache, v_cache, meta, query, key, value, _ = build_step([1, 1, 30], [300, 40, 90], 4, 2, 16, 16, 64, seed=5)
    ref = torch_ref.TorchAttentionBackend()
    want = ref.forward(query, key, value, k_cache.clone(), v_cache.clone(), meta, 0.25, 9)
    full = ref.forward(query, key, value, k_cache.clone(), v_cache.clone(), meta, 0.25)
    pad = lambda t: torch.cat([t, torch.zeros(3, *t.shape[1:])])  # noqa: E731
    padded = dataclasses.replace(meta, slot_mapping=torch.cat([meta.slot_mapping, torch.full((3,), -1)]))
    with step_context(torch_ref.TorchAttentionBackend(), padded, [(k_cache, v_cache)], query.shape[0]):
        got = torch.ops.pagedserve.paged_attention(pad(query), pad(key), pad(value), 0, 0.25, 9)
        got_full = torch.ops.pagedserve.paged_attention(pad(query), pad(key), pad(value), 0, 0.25)
    torch.testing.assert_close(got[:query.shape[0]], want, atol=0, rtol=0)
    torch.testing.assert_close(got_full[:query.shape[0]], full, atol=0, rtol=0)
    assert not (got[:query.shape[0]] - full).abs().max() < 1e-3 and not got[query.shape[0]:].any()
    sinks = torch.linspace(-2, 2, 4)   # and the layer's soft-cap and sinks
    want = ref.forward(query, key, value, k_cache.clone(), v_cache.clone(), meta, 0.25, 9, softcap=1.5, sinks=sinks)
    with step_context(torch_ref.TorchAttentionBackend(), padded, [(k_cache, v_cache)], query.shape[0]):
        got = torch.ops.pagedserve.paged_attention(pad(query), pad(key), pad(value), 0, 0.25, 9, 1.5, sinks)
    torch.testing.assert_close(got[:query.shape[0]], want, atol=0, rtol=0)
