"""CUDA kernels without a GPU: NVRTC compiles for sm_80 / sm_90 with no register spills, and launch geometry.
(Argument checks and launch signatures: tests/kernel_tests/test_kernel_checks.py.)"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve import kernels
from pagedserve.kernels import ModuleKey, compile_to_cubin, cubin, sources
from pagedserve.kernels import geometry as geo
from support import REPO_ROOT

needs_nvrtc = pytest.mark.skipif(not kernels.nvrtc_available(),
                                 reason="NVRTC (nvidia-cuda-nvrtc) or the CUDA headers are not installed")

# (family, dtype, head_dim, block_size, arch): every head dim and dtype for sm_90, a spread for sm_80.
ATTENTION_KEYS = [
    *(ModuleKey(f, d, hd, 16, "sm_90") for f in ("decode", "prefill")
      for d in ("float16", "bfloat16", "float32") for hd in (64, 128, 256)),
    *(ModuleKey(f, d, hd, bs, "sm_80") for f in ("decode", "prefill")
      for d, hd, bs in (("float16", 128, 16), ("bfloat16", 64, 32), ("float32", 256, 32))),
    ModuleKey("decode", "bfloat16", 128, 32, "sm_90"), ModuleKey("prefill", "float16", 64, 32, "sm_90"),
]
OTHER_KEYS = [ModuleKey("cache", arch=a) for a in ("sm_80", "sm_90")] + [
    ModuleKey("elementwise", d, arch="sm_90") for d in ("float16", "bfloat16", "float32")] + [
    ModuleKey("elementwise", "bfloat16", arch="sm_80")] + [
    ModuleKey("moe", d, arch="sm_90") for d in ("float16", "bfloat16", "float32")] + [
    ModuleKey("moe", "bfloat16", arch="sm_80")]


@functools.cache
def compile_all() -> dict[ModuleKey, kernels.CubinResult]:
    """Every key compiled once per session, two at a time (NVRTC releases the GIL)."""
    keys = ATTENTION_KEYS + OTHER_KEYS
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(keys, pool.map(compile_to_cubin, keys)))


def compiled(key: ModuleKey) -> kernels.CubinResult:
    return compile_all()[key]


def test_sources_inline_local_includes():
    src = kernels.load_source("decode_attention.cu")
    assert not [line for line in src.splitlines() if line.strip().startswith('#include "')]
    assert "namespace pagedserve" in src and "paged_decode_kernel" in src
    assert '#line 1 "common.cuh"' in src
    with pytest.raises(FileNotFoundError):
        kernels.load_source("missing.cu")


@needs_nvrtc
def test_options_point_at_cuda_headers():
    opts = kernels.nvrtc_options()
    assert "-std=c++17" in opts and not any("fast_math" in o for o in opts)
    assert any(o.startswith("-I") for o in opts)


@needs_nvrtc
@pytest.mark.parametrize("key", ATTENTION_KEYS + OTHER_KEYS, ids=str)
def test_every_instantiation_compiles(key):
    result = compiled(key)
    assert result.cubin[:4] == b"\x7fELF"
    assert set(result.resources) == set(key.name_expressions()), "ptxas reported every kernel"
    assert all(res.registers <= 255 for res in result.resources.values())


@needs_nvrtc
@pytest.mark.parametrize("key", ATTENTION_KEYS, ids=str)
def test_attention_kernels_do_not_spill(key):
    for name, res in compiled(key).resources.items():
        assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_frame_bytes == 0, \
            f"{name} ({key.arch}): {res}"


def test_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 42 registers, used 1 barriers\n")
    assert cubin.parse_ptxas_log(log) == {"_Z3fooPf": cubin.KernelResources(42, 16, 8, 4)}


# ---- geometry -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads,tile", [(8, 8, 1), (16, 8, 2), (9, 3, 4), (32, 8, 4), (28, 4, 8),
                                                 (64, 8, 8), (32, 2, 8)])
def test_gqa_tile(heads, kv_heads, tile):
    assert geo.decode_gqa_tile(heads, kv_heads) == tile


def test_decode_plan_short_contexts_do_not_split():
    plan = geo.plan_decode("float16", [256] * 64, 32, 8, 128, 16)
    assert plan.num_partitions == 1 and plan.grid == (1, 8, 64) and plan.partition_size == 256
    assert plan.block == (128, 1, 1) and plan.gqa_tile == 4
    assert plan.smem_bytes == 4 * 4 * 2 * 4 * 32 * 16  # 4 warps x 4 stages x (K, V) x 8 tokens of 256 bytes


def test_decode_smem_mirrors_kernel_layout():
    # fp32 head_dim 256: 2 vectors per lane, 2 steps per chunk -> the same 64 KiB ring; the merge needs less.
    assert geo.decode_smem_bytes("float32", 256, 32, 8) == 4 * 4 * 2 * 2 * 2 * 32 * 16
    # GQA tile 8 halves the steps (16 scores per lane) -> 32 KiB ring; merge 4 * 8 * 128 floats + stats.
    assert geo.decode_smem_bytes("float16", 128, 16, 8) == 32768
    # head_dim 64 fp16: 8 lanes per row, 4 rows per step, 4 steps.
    assert geo.decode_smem_bytes("bfloat16", 64, 16, 1) == 4 * 4 * 2 * 4 * 32 * 16


@pytest.mark.parametrize("ctx", [[8192] * 64, [16384], [1, 16000, 7, 300, 4096], [2048] * 64, [257]])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_plan_split(ctx, block_size):
    """The slots are the most fixed 256-key partitions any context reads, whatever the batch size."""
    plan = geo.plan_decode("bfloat16", ctx, 32, 8, 128, block_size)
    assert plan.partition_size == geo.DECODE_PARTITION == 256
    assert plan.num_partitions == -(-max(ctx) // 256) > 1
    assert plan.grid == (plan.num_partitions, 8, len(ctx))
    assert plan.merge_grid == (32, len(ctx), 1) and plan.merge_smem_bytes == 0


def test_decode_partitions_sit_at_absolute_positions():
    """Partition p holds keys [256 p, 256 p + 256): a decode reads those from its first key's to its last key's,
    under a window too; the kernels' constant is the planner's."""
    count = geo.decode_num_partitions
    assert [count(c) for c in (0, 1, 256, 257, 512, 513)] == [0, 1, 1, 2, 2, 3]
    assert count(600, 100) == 2 and count(600, 88) == 1 and count(513, 2) == 2 and count(1500, 700) == 3
    assert "constexpr int kDecodePartition = 256;" in kernels.load_source("decode_attention.cu")
    assert "kDecodePartition" in kernels.load_source("prefill_attention_fp32.cu")
    for w in (1, 2, 255, 256, 257, 700):  # the fixed grid's window bound is reached and never exceeded
        assert max(count(c, w) for c in range(1, 3000)) == geo.plan_decode_fixed("float32", 1, 3000, 4, 4, 64, 16,
                                                                                  sliding_window=w).num_partitions


def test_decode_plan_groups_larger_than_tile():
    plan = geo.plan_decode("float32", [100, 200], 32, 2, 64, 16)  # group 16 -> 2 tiles of 8
    assert plan.gqa_tile == 8 and plan.grid[1] == 4


def test_prefill_geometry():
    g = geo.plan_prefill("float16", 128, 32, 3, 200)
    assert g.grid == (4, 32, 3) and g.block == (128, 1, 1) and g.smem_bytes == 2 * 128 * (64 + 128)
    assert geo.plan_prefill("bfloat16", 256, 8, 1, 1).smem_bytes == 2 * 256 * (64 + 64)
    f = geo.plan_prefill("float32", 64, 4, 2, 33, 4, 16)  # GQA tile 1: 8 rows a block, the decode ring's smem
    assert f.grid == (5, 4, 2) and f.smem_bytes == geo.decode_smem_bytes("float32", 64, 16, 1, 8) == 65536
    f = geo.plan_prefill("float32", 256, 8, 1, 33, 2, 32)  # GQA tile 4 at head_dim 256: 1 row a block
    assert f.grid == (33, 2, 1) and geo.prefill_fp32_rows(256, 4) == 1 and geo.prefill_fp32_rows(128, 2) == 4


def test_row_geometry_and_vectors():
    assert geo.rows_block(1) == 32 and geo.rows_block(72) == 96 and geo.rows_block(10**6) == 1024
    assert geo.plan_silu_and_mul(5, 192).grid == (5, 1, 1) and geo.plan_silu_and_mul(5, 1000).grid == (5, 4, 1)
    assert geo.copy_unit_bytes(4096, 32) == 16 and geo.copy_unit_bytes(4096, 36) == 4 and geo.copy_unit_bytes(6) == 2
    assert geo.vec_for_rows("bfloat16", 576, 0, 1152) == 8 and geo.vec_for_rows("float16", 100, 0, 200) == 1
    assert geo.vec_for_rows("float32", 64, 8) == 1
    assert "__nv_bfloat16, 128, 32, 4, 4>" in geo.decode_kernel_name("bfloat16", 128, 32, 4)


def test_sources_found_in_the_source_tree_and_from_a_folder(tmp_path):
    """From the source tree the repository's cuda/ (an installed package's copy: tests/repo/test_packaging.py); an
    explicit folder (edited copies) wins for that call only."""
    repo_cuda = REPO_ROOT / "cuda"
    assert kernels.find_source_dir() == repo_cuda
    assert sources.source_dir_candidates()[0].parent == Path(sources.__file__).resolve().parent
    (tmp_path / "decode_attention.cu").write_text('#include "common.cuh"\n// copy\n')
    (tmp_path / "common.cuh").write_text("#pragma once\nint marker_from_folder;\n")
    assert "marker_from_folder" in kernels.load_source("decode_attention.cu", tmp_path)
    assert "paged_decode_kernel" in kernels.load_source("decode_attention.cu")
