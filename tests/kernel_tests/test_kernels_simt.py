"""The CUDA kernels of cuda/ run on the CPU through the host emulator (tests/simt) and checked against their torch
references: the same checks as the GPU tests (tests/kernel_cases.py) on smaller shapes, through the public
launchers of pagedserve.kernels (argument checks, split-K plans, launch geometry and all). The emulator runs the
kernels' own code (warp shuffles, ldmatrix and mma fragment layouts, cp.async pipelines, shared-memory layouts),
not a model of it; what it cannot show (timing, races between threads of a block) is said in simt_host.hpp."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import kernel_cases as kc
from pagedserve.kernels import ModuleKey
from pagedserve.kernels import geometry as geo
from simt import Simulator, SimtError, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

CPU = torch.device("cpu")
# (context lengths, num_heads, num_kv_heads): GQA ratios 1, 4 (tile 4), 8, 3 (tile 4 with 1 head unused),
# 16 (two tiles of 8 per KV head); contexts 1, block-boundary +/- 1, ragged, one past the split-K threshold.
DECODE_CASES = [
    ([1, 16, 17, 33], 4, 4),
    ([random.Random(1).randint(1, 200) for _ in range(12)], 8, 2),
    ([1, 31, 700], 8, 1),
    ([77, 160, 3], 9, 3),
    ([300, 31], 32, 2),
    ([16384, 5000, 1], 8, 2),  # long contexts: 16k reads 64 partitions of 256 keys
]
# Batch 256 (the GPU tests' largest), contexts 1..300, GQA 8: one config.
BATCH_256 = ([random.Random(3).randint(1, 300) for _ in range(256)], 32, 4)
# (dtype, head_dim, block_size): every dtype and head dim, and both block sizes.
DECODE_CONFIGS = [(d, 128, 16) for d in kc.DTYPES] + [(d, hd, 32) for d in kc.DTYPES for hd in (64, 256)]
PREFILL_CONFIGS = [(d, hd, 16) for d in kc.DTYPES for hd in (64, 128, 256)] + [
    (torch.float16, 128, 32), (torch.bfloat16, 64, 32), (torch.float32, 128, 32)]


def module_keys() -> list[ModuleKey]:
    keys = {ModuleKey("decode", geo.dtype_name(d), hd, bs, "simt") for d, hd, bs in DECODE_CONFIGS}
    keys |= {ModuleKey("prefill", geo.dtype_name(d), hd, bs, "simt") for d, hd, bs in PREFILL_CONFIGS}
    keys |= {ModuleKey("elementwise", geo.dtype_name(d), arch="simt") for d in kc.DTYPES}
    keys |= {ModuleKey("moe", geo.dtype_name(d), arch="simt") for d in kc.DTYPES}
    keys.add(ModuleKey("cache", arch="simt"))
    return sorted(keys, key=str)


@pytest.fixture(scope="module")
def sim():
    s = Simulator()
    s.precompile(module_keys())  # g++ in parallel, cached on disk by source hash
    with s.install():
        yield s


@pytest.mark.parametrize("dtype,head_dim,block_size", DECODE_CONFIGS, ids=str)
def test_decode_matches_reference(sim, dtype, head_dim, block_size):
    cases = DECODE_CASES if head_dim == 128 else DECODE_CASES[1:3]  # 256: the reference's dense gather is big
    kc.check_decode(CPU, dtype, head_dim, block_size, cases)


def test_decode_batch_256(sim):
    kc.check_decode(CPU, torch.float16, 128, 16, [BATCH_256])


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_decode_split_k_partitions_agree(sim, dtype):
    """Contexts of one partition and of several (256-key partitions at absolute positions, merged in order by
    log-sum-exp) equal the reference; each sequence alone, and in a CUDA graph's wider fixed grid, is the same bits
    as in the batch."""
    plan = kc.check_decode_partitions(CPU, dtype, [1, 31, 256, 257, 1500, 600], 8, 2, 128, 16)
    assert plan.num_partitions == 6 and plan.partition_size == geo.DECODE_PARTITION == 256
    launched = [name for name, *_ in sim.launches]
    assert any(name.startswith("paged_decode_merge_kernel") for name in launched)


# Sliding windows on float16 (one key, inside a block, a block multiple, mid-context, wider than every context),
# one each on the other dtypes and the other head dim / block size.
DECODE_WINDOWS = [((torch.float16, 128, 16), w) for w in (1, 5, 32, 100, 20000)] + [
    ((torch.bfloat16, 128, 16), 100), ((torch.float32, 128, 16), 5), ((torch.float16, 64, 32), 100)]
PREFILL_WINDOWS = [((torch.float16, 128, 16), w) for w in (1, 7, 64, 100)] + [
    ((torch.bfloat16, 128, 16), 64), ((torch.float32, 128, 16), 7), ((torch.bfloat16, 64, 32), 100)]


@pytest.mark.parametrize("config,window", DECODE_WINDOWS, ids=str)
def test_decode_sliding_window_matches_reference(sim, config, window):
    """Decodes under a sliding window: each context's last ``window`` tokens only, and only the blocks of the
    window's read (the table entries before it point outside the cache: a read there stops the emulator)."""
    dtype, head_dim, block_size = config
    kc.check_decode(CPU, dtype, head_dim, block_size, DECODE_CASES[:3] + DECODE_CASES[4:], window=window)


@pytest.mark.parametrize("window", [33, 700])
def test_decode_sliding_window_split_k(sim, window):
    """A window's keys over the fixed partitions (the window's first key mid-partition, mid-block), merged in
    order, equal the reference, alone and in the batch the same bits."""
    kc.check_decode_partitions(CPU, torch.bfloat16, [1, 31, 32, 33, 1500, 600], 8, 2, 128, 16, window=window)


@pytest.mark.parametrize("config,window", PREFILL_WINDOWS, ids=str)
def test_prefill_sliding_window_matches_reference(sim, config, window):
    """Prefill chunks under a sliding window: after cached prefixes longer than the window (whole key tiles
    skipped), chunks longer than the window (rows whose window starts mid-tile), a one-token chunk."""
    dtype, head_dim, block_size = config
    kc.check_prefill(CPU, dtype, head_dim, block_size, prefix=[2 * block_size, 33, 300, 0, 5],
                     new=[70, 5, 130, 150, 1], decode_ctx=(300, 1), heads_kv=(4, 2), window=window)


# Soft-capped scores (Gemma 2) and attention sinks (gpt-oss), alone and with a window, on every dtype.
SOFTCAP_SINKS = [(torch.float16, 1.0, False, None), (torch.bfloat16, None, True, None),
                 (torch.float32, 0.8, True, 100), (torch.float16, None, True, 33)]


@pytest.mark.parametrize("dtype,softcap,sinks,window", SOFTCAP_SINKS, ids=str)
def test_decode_softcap_and_sinks_match_reference(sim, dtype, softcap, sinks, window):
    """Decodes with a soft-cap (each score c tanh(s / c)) and sink logits (one more denominator term per head):
    one partition and several (the merge kernel adds the sink), against the reference."""
    kc.check_decode(CPU, dtype, 128, 16, DECODE_CASES[:3], window=window, softcap=softcap, sinks=sinks)
    kc.check_decode_partitions(CPU, dtype, [1, 33, 1500, 600], 8, 2, 128, 16, window=window, softcap=softcap,
                               sinks=sinks)


@pytest.mark.parametrize("dtype,softcap,sinks,window", SOFTCAP_SINKS, ids=str)
def test_prefill_softcap_and_sinks_match_reference(sim, dtype, softcap, sinks, window):
    """Prefill chunks (tensor cores for fp16/bf16, the fp32 kernel) with a soft-cap and sink logits."""
    kc.check_prefill(CPU, dtype, 128, 16, prefix=[32, 0, 150], new=[70, 100, 1], decode_ctx=(300,),
                     heads_kv=(4, 2), window=window, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("dtype,head_dim,block_size", PREFILL_CONFIGS, ids=str)
def test_prefill_matches_reference(sim, dtype, head_dim, block_size):
    """Prefill chunks after cached prefixes (block-aligned, unaligned, none), a chunk longer than one 64-row tile,
    and a one-token chunk that follows prefills; two decode rows before them stay untouched."""
    kc.check_prefill(CPU, dtype, head_dim, block_size, prefix=[2 * block_size, 33, 150, 0, 5],
                     new=[70, 5, 130, 100, 1], decode_ctx=(300, 1), heads_kv=(4, 2))


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_prefill_after_long_prefix(sim, dtype):
    """Chunks after a 15,000-token cached prefix (235 K/V tiles per query tile)."""
    kc.check_prefill(CPU, dtype, 128, 16, prefix=[15000, 333], new=[130, 64], decode_ctx=(3000,), heads_kv=(4, 2))


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_reshape_and_cache_is_exact(sim, dtype):
    kc.check_reshape_and_cache(CPU, dtype)


def test_copy_blocks_is_exact(sim):
    kc.check_copy_blocks(CPU)


@pytest.mark.parametrize("hidden", [576, 100])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_rms_norm(sim, dtype, hidden):
    kc.check_rms_norm(CPU, dtype, hidden, rows=9)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_rotary_embedding(sim, dtype, is_neox):
    kc.check_rotary(CPU, dtype, 64, is_neox, tokens=9)


@pytest.mark.parametrize("shape", [(9, 2 * 1536), (5, 2 * 7)])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_silu_and_mul(sim, dtype, shape):
    kc.check_silu_and_mul(CPU, dtype, shape)


# ---- the GPU tests' whole grid (about 8 minutes here): PAGEDSERVE_SIMT_FULL=1 ---------------------------------------
ALL_CONFIGS = [(d, hd, bs) for d in kc.DTYPES for hd in (64, 128, 256) for bs in (16, 32)]
full_grid = pytest.mark.skipif(os.environ.get("PAGEDSERVE_SIMT_FULL") != "1",
                               reason="the GPU tests' full grid on the emulator takes ~8 min: PAGEDSERVE_SIMT_FULL=1")


@full_grid
def test_gpu_grid_decode(sim):
    """tests/kernel_tests/gpu/test_kernels_gpu.py's decode grid (batch 256, contexts to 16k, GQA 1..16) for every config."""
    for dtype, head_dim, block_size in ALL_CONFIGS:
        kc.check_decode(CPU, dtype, head_dim, block_size, kc.GPU_DECODE_CASES, max_seqs_256=64)


@full_grid
def test_gpu_grid_prefill(sim):
    """tests/kernel_tests/gpu/test_kernels_gpu.py's prefill grid (a 15,000-token prefix, a 1,000-token chunk) for every
    config."""
    for dtype, head_dim, block_size in ALL_CONFIGS:
        kc.check_prefill(CPU, dtype, head_dim, block_size, **kc.gpu_prefill_case(block_size))


# ---- the checks have teeth: a planted bug fails them ----------------------------------------------------------------
planted = kc.planted


@pytest.mark.parametrize("old,new", [
    ("cp_async_wait<kS - 1>();", "cp_async_wait<kS>();"),  # decode reads a chunk before its copy lands
    ("exp2f(st.m[g] - base)", "1.f"),                        # decode forgets to rescale the running sum
], ids=["decode-early-read", "decode-no-rescale"])
def test_planted_decode_bug_is_caught(old, new):
    with Simulator(transform=planted(old, new)).install():
        with pytest.raises(AssertionError):
            kc.check_decode(CPU, torch.float16, 128, 16, DECODE_CASES[2:3])


@pytest.mark.parametrize("old,new", [
    ("ldmatrix_x4_trans(b, s_v", "ldmatrix_x4(b, s_v"),  # V fragments not transposed
    ("const int pos = e < 2 ? pos0 : pos1;", "const int pos = pos0;"),  # wrong causal row
], ids=["prefill-v-layout", "prefill-mask"])
def test_planted_prefill_bug_is_caught(old, new):
    with Simulator(transform=planted(old, new)).install():
        with pytest.raises(AssertionError):
            kc.check_prefill(CPU, torch.bfloat16, 64, 16, prefix=[0, 20], new=[40, 9], decode_ctx=(), heads_kv=(2, 1))


@pytest.mark.parametrize("old,new,check", [
    # decode: the window one key too wide
    ("return sliding_window > 0 ? max(0, end - sliding_window) : 0;",
     "return sliding_window > 0 ? max(0, end - sliding_window - 1) : 0;", "decode"),
    # decode merge: partitions counted from the context's start, not the window's first key
    ("return first_key(ctx, sliding_window) / kDecodePartition;", "return 0;", "split"),
    # prefill (tensor cores): the window one key too wide
    ("key <= pos - sliding_window))", "key < pos - sliding_window))", "prefill"),
    # prefill (fp32): the window one key too narrow
    ("begin[r] = valid ? first_key(end[r], sliding_window) : 0;",
     "begin[r] = valid ? first_key(end[r], sliding_window) + 1 : 0;", "prefill32"),
], ids=["decode-window", "merge-window", "prefill-window", "prefill32-window"])
def test_planted_sliding_window_bug_is_caught(old, new, check):
    with Simulator(transform=planted(old, new)).install():
        with pytest.raises(AssertionError):
            if check == "decode":
                kc.check_decode(CPU, torch.float16, 128, 16, DECODE_CASES[2:3], window=100)
            elif check == "split":
                kc.check_decode_partitions(CPU, torch.float16, [1500, 600], 8, 2, 128, 16, window=700)
            else:
                dtype = torch.bfloat16 if check == "prefill" else torch.float32
                kc.check_prefill(CPU, dtype, 64, 16, prefix=[0, 20], new=[40, 9], decode_ctx=(), heads_kv=(2, 1),
                                 window=7)


@pytest.mark.parametrize("old,new,check", [
    # decode: the soft-cap dropped
    ("if (softcap_log2 > 0.f) dot = softcap_log2 * tanhf(dot / softcap_log2);", "", "decode-cap"),
    # the sink's term left out of the denominator (decode, its merge and the fp32 prefill: finish_state)
    ("run.l = fmaf(run.l, w, exp2f(sink - mx));", "run.l = run.l * w;", "merge-sink"),
    # prefill (tensor cores): the sink's term left out
    ("l_run0 = l_run0 * w0 + exp2f(sink - mx0);", "l_run0 = l_run0 * w0;", "prefill-sink"),
    # prefill (fp32): the soft-cap dropped (attend_chunk, which it shares with decode)
    ("if (softcap_log2 > 0.f) dot = softcap_log2 * tanhf(dot / softcap_log2);", "", "prefill32-cap"),
], ids=["decode-softcap", "merge-sink", "prefill-sink", "prefill32-softcap"])
def test_planted_softcap_and_sink_bugs_are_caught(old, new, check):
    with Simulator(transform=planted(old, new)).install():
        with pytest.raises(AssertionError):
            if check == "decode-cap":
                kc.check_decode(CPU, torch.float16, 128, 16, DECODE_CASES[2:3], softcap=1.0)
            elif check == "merge-sink":
                kc.check_decode_partitions(CPU, torch.float16, [1500, 600], 8, 2, 128, 16, sinks=True)
            else:
                dtype = torch.bfloat16 if check == "prefill-sink" else torch.float32
                kc.check_prefill(CPU, dtype, 64, 16, prefix=[0, 20], new=[40, 9], decode_ctx=(), heads_kv=(2, 1),
                                 softcap=1.0 if check == "prefill32-cap" else None, sinks=check == "prefill-sink")


def test_planted_out_of_bounds_read_is_caught():
    """The decode kernel reads block-table entries for chunks past the context end (it must not): for the last
    sequence that runs past the table tensor, and the emulator stops the launch."""
    bug = planted("return chunk < hi ? __ldg(table + chunk / L::kBlockSize) : 0;",
                  "return __ldg(table + chunk / L::kBlockSize);")
    with Simulator(transform=bug).install():
        with pytest.raises(SimtError, match="outside every tensor argument"):
            kc.check_decode(CPU, torch.float16, 128, 16, DECODE_CASES[2:3])


def test_decode_traps_on_too_little_shared_memory():
    """The kernel's own guard: launched with less dynamic shared memory than its layout needs, it traps. (Thread
    order, so thread 0's check runs before any other thread stages into the missing memory, which the emulator
    would report first otherwise.)"""
    sim = Simulator(seed=0)
    dtype, ctx = "float16", [40]
    plan = geo.plan_decode(dtype, ctx, 4, 4, 128, 16)
    q = torch.zeros(1, 4, 128, dtype=torch.float16)
    cache = torch.zeros(4, 16, 4, 128, dtype=torch.float16)
    table, lens = torch.zeros(1, 3, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
    ptr = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    args = (ptr(q), np.uint64(0), np.uint64(0), np.uint64(0), ptr(q), ptr(cache), ptr(cache), ptr(table), ptr(lens),
            np.int64(512), np.int64(512), np.int32(3), np.int32(4), np.int32(4), np.float32(1.0), np.int32(0),
            np.float32(0.0), np.uint64(0))
    name = geo.decode_kernel_name(dtype, 128, 16, plan.gqa_tile)
    key = ModuleKey("decode", dtype, 128, 16, "simt")
    sim.launch(key, name, CPU, plan.grid, plan.block, args, plan.smem_bytes)  # the right size runs
    with pytest.raises(SimtError, match="__trap"):
        sim.launch(key, name, CPU, plan.grid, plan.block, args, plan.smem_bytes // 2)


@pytest.mark.parametrize("softmax_first,renormalize", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (5, 5)])
def test_moe_topk_matches_the_routers(sim, softmax_first, renormalize, num_experts, top_k):
    """cuda/moe.cu's router against models/moe.py's torch routing (softmax first: Mixtral / Qwen3-MoE, with and
    without renormalizing; top-k first: gpt-oss): the same experts in the same order, weights within 1e-6."""
    from pagedserve.kernels.moe import moe_topk

    logits = torch.randn(37, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 3
    weights, ids = moe_topk(logits, top_k, softmax_first, renormalize)
    if softmax_first:
        want_w, want_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if renormalize:
            want_w = want_w / want_w.sum(-1, keepdim=True)
    else:
        top, want_ids = torch.topk(logits, top_k, dim=-1)
        want_w = torch.softmax(top, dim=-1)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


def test_moe_topk_breaks_ties_to_the_lower_expert(sim):
    from pagedserve.kernels.moe import moe_topk

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]])
    _, ids = moe_topk(logits, 4, True, False)
    assert ids.tolist() == [[1, 2, 4, 5]]
    with pytest.raises(ValueError, match="^top_k"):
        moe_topk(logits, 7, True, False)


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_moe_combine_sums_each_tokens_rows(sim, dtype):
    """Each token's rows summed in float32 in the order given, rounded once."""
    from pagedserve.kernels.moe import moe_combine

    g = torch.Generator().manual_seed(5)
    src = torch.randn(40 * 3, 200, generator=g).to(dtype)
    rows = torch.randperm(120, generator=g).view(40, 3).to(torch.int32)
    want = src.float()[rows.long()].sum(1).to(dtype)
    torch.testing.assert_close(moe_combine(src, rows), want, atol=0, rtol=0)
