"""Batch invariance of the CUDA attention kernels, on the host emulator (tests/simt): a query row's output is the same
bits whatever it is launched with. Decode: a sequence alone, among batch-mates of other lengths, in a CUDA graph's
fixed grid of any capacity, on a device of any SM count (the split-K partitions are 256 keys at absolute positions,
cuda/decode_attention.cu). Prefill: a prompt's rows whole or chunked (16 / 64 tokens), beside other sequences; in
float32 each prefill row is also the decode of its position, bit for bit (prefill_attention_fp32.cu runs the decode
kernel's partitions). Accuracy against the torch reference: test_kernels_simt.py."""
from __future__ import annotations

import pytest
import torch

import kernel_cases as kc
from pagedserve import kernels
from pagedserve.kernels import geometry as geo
from paged_batch import make_caches
from simt import Simulator, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
CPU = torch.device("cpu")
SCALE = 0.1


class Paged:
    """Sequences of the given context lengths in one paged cache (scattered blocks) with a query row per position
    of each (the decode of position p of sequence s reads query[s][p] at context p + 1)."""

    def __init__(self, dtype, ctx, heads, kv_heads, head_dim, block_size=16, seed=0):
        self.ctx, self.heads = list(ctx), heads
        gen = torch.Generator().manual_seed(seed)
        need = [-(-c // block_size) for c in ctx]
        num_blocks = sum(need) + 1
        self.k, self.v = make_caches(num_blocks, block_size, kv_heads, head_dim, dtype, CPU, seed=seed)
        physical = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.tables = torch.full((len(ctx), max(need)), num_blocks - 1, dtype=torch.int32)
        offset = 0
        for s, n in enumerate(need):
            self.tables[s, :n] = physical[offset:offset + n]
            offset += n
        self.query = [torch.randn(c, heads, head_dim, generator=gen).to(dtype) for c in ctx]

    def decode(self, rows, plan=None, window=None, **kw):
        """One decode launch over ``rows`` = [(sequence, context length)], in that order."""
        q = torch.stack([self.query[s][c - 1] for s, c in rows])
        tables = self.tables[[s for s, _ in rows]].contiguous()
        lens = torch.tensor([c for _, c in rows], dtype=torch.int32)
        return kc.decode_once(q, self.k, self.v, tables, lens, SCALE, plan=plan, sliding_window=window, **kw)

    def prefill(self, chunks, window=None, **kw):
        """Prefill launches: ``chunks`` is a list of launches, each a list of (sequence, first position, tokens);
        returns each sequence's rows assembled from its chunks (positions never computed stay NaN)."""
        rows = [torch.full_like(q, float("nan")) for q in self.query]
        for launch in chunks:
            q = torch.cat([self.query[s][p:p + n] for s, p, n in launch])
            out = torch.full_like(q, float("nan"))
            starts = torch.tensor([0] + [n for *_, n in launch], dtype=torch.int32).cumsum(0).to(torch.int32)
            kernels.paged_prefill_attention(
                out, q, self.k, self.v, self.tables[[s for s, *_ in launch]].contiguous(),
                torch.tensor([p + n for _, p, n in launch], dtype=torch.int32), starts, SCALE, seq_offset=0,
                num_prefill_seqs=len(launch), max_query_len=max(n for *_, n in launch), sliding_window=window, **kw)
            for (s, p, n), o in zip(launch, out.split([n for *_, n in launch])):
                rows[s][p:p + n] = o
        return rows


@pytest.fixture(scope="module")
def sim():
    with Simulator().install() as s:
        yield s


def chunked(s: int, length: int, size: int) -> list[tuple[int, int, int]]:
    return [(s, p, min(size, length - p)) for p in range(0, length, size)]


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 700], ids=["full", "window700"])
def test_decode_is_batch_invariant(dtype, window):
    """Sequences of 400, 1500 and 257 tokens decode to the same bits alone, between batch-mates of other lengths
    (before and after them), eight to a batch, and through the fixed grids of CUDA graphs of two capacities, on
    emulated devices of 132 SMs and of 1. The batch-dependent plan this replaced split 400 tokens not at all alone
    but into 128-token partitions beside a 3000-token mate, and 1500 tokens into 512-token partitions alone but
    1024-token ones eight to a batch on 1 SM."""
    p = Paged(dtype, [400, 1500, 257, 3000, 1, 700], heads=8, kv_heads=2, head_dim=128, seed=1)
    targets = [(0, 400), (1, 1500), (2, 257)]
    name = geo.dtype_name(dtype)
    for sms in (132, 1):
        with Simulator(num_sms=sms).install():
            alone = [p.decode([t], window=window) for t in targets]
            mixed = p.decode([(3, 3000), (0, 400), (4, 1), (1, 1500), (5, 700), (2, 257)], window=window)
            eight = p.decode([(1, 1500)] * 8, window=window)
            for cap in (2048, 4096):
                fixed = geo.plan_decode_fixed(name, 3, cap, 8, 2, 128, 16, sliding_window=window or 0)
                graph = p.decode(targets, plan=fixed, window=window)
                for i, t in enumerate(targets):
                    kc.assert_same_bits(graph[i:i + 1], alone[i], f"{t} in a graph of capacity {cap}, {sms} SMs")
            for i, row in zip(range(3), (1, 3, 5)):
                kc.assert_same_bits(mixed[row:row + 1], alone[i], f"{targets[i]} among mates, {sms} SMs")
            for row in range(8):
                kc.assert_same_bits(eight[row:row + 1], alone[1], f"1500 tokens, row {row} of 8, {sms} SMs")
            if sms == 132:
                reference = alone
            for i, t in enumerate(targets):
                kc.assert_same_bits(alone[i], reference[i], f"{t} alone on {sms} SMs vs 132")


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_prefill_is_chunk_invariant(sim, dtype, window):
    """A 300-token prompt's rows are the same bits prefilled whole, in 16- and in 64-token chunks, and with its
    chunks sharing launches with another prompt's (tensor cores for fp16 / bf16, the decode partitions for fp32):
    the key tiles sit at absolute key positions and a row's reduction never depends on its tile-mates."""
    p = Paged(dtype, [300, 90], heads=8, kv_heads=2, head_dim=64, seed=2)
    whole = p.prefill([[(0, 0, 300)]], window=window)[0]
    for size in (16, 64):
        rows = p.prefill([[c] for c in chunked(0, 300, size)], window=window)[0]
        kc.assert_same_bits(rows, whole, f"{size}-token chunks")
    mates = chunked(1, 90, 30)
    shared = [[(0, 0, 40), mates[0]], [mates[1], (0, 40, 200)], [(0, 240, 60), mates[2]]]
    kc.assert_same_bits(p.prefill(shared, window=window)[0], whole, "chunks beside another prompt's")


FP32_CASES = [  # (heads, kv_heads, head_dim, window, softcap, sinks): GQA tiles 1, 4 (one head unused), 8, 2
    (4, 4, 128, None, None, False), (9, 3, 128, 100, None, False), (16, 2, 64, None, 0.8, True),
    (8, 4, 256, 300, None, True)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,window,softcap,sinks", FP32_CASES, ids=str)
def test_fp32_prefill_rows_equal_decodes(sim, heads, kv_heads, head_dim, window, softcap, sinks):
    """Every row of a float32 prefill (whole, and in 64-token chunks) is the same bits as the decode of its position:
    the same 256-key partitions, the same per-partition arithmetic and the same in-order merge, one to several
    partitions, under a sliding window, a soft-cap and attention sinks."""
    n = 520 if head_dim < 256 else 300  # 3 partitions (2 at head_dim 256)
    p = Paged(torch.float32, [n], heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=3)
    kw = dict(softcap=softcap, sinks=kc.head_sinks(heads, CPU) if sinks else None)
    decodes = p.decode([(0, c) for c in range(1, n + 1)], window=window, **kw)
    whole = p.prefill([[(0, 0, n)]], window=window, **kw)[0]
    kc.assert_same_bits(whole, decodes, "prefill rows vs decodes")
    kc.assert_same_bits(p.prefill([[c] for c in chunked(0, n, 64)], window=window, **kw)[0], decodes, "chunked")
