"""CUDA kernels without a GPU: NVRTC compiles for sm_80 / sm_90 with no register spills, launch geometry, and the
argument checks that must reject bad inputs before any CUDA call."""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedserve import kernel_build, kernel_geometry as geo, kernels
from pagedserve.attention import TorchAttentionBackend, select_attention_backend
from pagedserve.attention.base import AttentionMetadata
from pagedserve.attention.cuda import CudaAttentionBackend
from pagedserve.kernel_build import ModuleKey, compile_to_cubin

needs_nvrtc = pytest.mark.skipif(not kernel_build.nvrtc_available(),
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
    ModuleKey("elementwise", "bfloat16", arch="sm_80")]


@functools.cache
def compile_all() -> dict[ModuleKey, kernel_build.CubinResult]:
    """Every key compiled once per session, two at a time (NVRTC releases the GIL)."""
    keys = ATTENTION_KEYS + OTHER_KEYS
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(keys, pool.map(compile_to_cubin, keys)))


def compiled(key: ModuleKey) -> kernel_build.CubinResult:
    return compile_all()[key]


def test_sources_inline_local_includes():
    src = kernel_build.load_source("decode_attention.cu")
    assert not [line for line in src.splitlines() if line.strip().startswith('#include "')]
    assert "namespace pagedserve" in src and "paged_decode_kernel" in src
    assert '#line 1 "common.cuh"' in src
    with pytest.raises(FileNotFoundError):
        kernel_build.load_source("missing.cu")


@needs_nvrtc
def test_options_point_at_cuda_headers():
    opts = kernel_build.nvrtc_options()
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
    assert kernel_build.parse_ptxas_log(log) == {"_Z3fooPf": kernel_build.KernelResources(42, 16, 8, 4)}


# ---- geometry -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads,tile", [(8, 8, 1), (16, 8, 2), (9, 3, 4), (32, 8, 4), (28, 4, 8),
                                                 (64, 8, 8), (32, 2, 8)])
def test_gqa_tile(heads, kv_heads, tile):
    assert geo.decode_gqa_tile(heads, kv_heads) == tile


def test_decode_plan_short_contexts_do_not_split():
    plan = geo.plan_decode([512] * 64, 32, 8, 128, 16, num_sms=132)
    assert plan.num_partitions == 1 and plan.grid == (1, 8, 64) and plan.partition_size >= 512
    assert plan.block == (128, 1, 1) and plan.gqa_tile == 4


@pytest.mark.parametrize("ctx", [[8192] * 64, [16384], [1, 16000, 7, 300, 4096], [2048] * 64])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_plan_split(ctx, block_size):
    plan = geo.plan_decode(ctx, 32, 8, 128, block_size, num_sms=132)
    size = plan.partition_size
    assert size % block_size == 0 and size >= geo.DECODE_MIN_PARTITION
    assert plan.num_partitions == -(-max(ctx) // size) > 1
    assert plan.grid == (plan.num_partitions, 8, len(ctx))
    assert plan.merge_grid == (32, len(ctx), 1) and plan.merge_smem_bytes == 4 * plan.num_partitions
    working = sum(-(-c // size) for c in ctx) * 8
    assert working >= 4 * 132 or size == geo.DECODE_MIN_PARTITION  # enough blocks to fill the GPU


def test_decode_plan_groups_larger_than_tile():
    plan = geo.plan_decode([100, 200], 32, 2, 64, 16, num_sms=132)  # group 16 -> 2 tiles of 8
    assert plan.gqa_tile == 8 and plan.grid[1] == 4


def test_prefill_geometry():
    g = geo.plan_prefill("float16", 128, 32, 3, 200)
    assert g.grid == (4, 32, 3) and g.block == (128, 1, 1) and g.smem_bytes == 2 * 128 * (64 + 128)
    assert geo.plan_prefill("bfloat16", 256, 8, 1, 1).smem_bytes == 2 * 256 * (64 + 64)
    f = geo.plan_prefill("float32", 64, 4, 2, 33)
    assert f.grid == (3, 4, 2) and f.smem_bytes == 4 * (16 * 64 + 32 * 65 + 32 * 64)


def test_row_geometry_and_vectors():
    assert geo.rows_block(1) == 32 and geo.rows_block(72) == 96 and geo.rows_block(10**6) == 1024
    assert geo.plan_silu_and_mul(5, 192).grid == (5, 1, 1) and geo.plan_silu_and_mul(5, 1000).grid == (5, 4, 1)
    assert geo.copy_unit_bytes(4096, 32) == 16 and geo.copy_unit_bytes(4096, 36) == 4 and geo.copy_unit_bytes(6) == 2
    assert geo.vec_for_rows("bfloat16", 576, 0, 1152) == 8 and geo.vec_for_rows("float16", 100, 0, 200) == 1
    assert geo.vec_for_rows("float32", 64, 8) == 1
    assert "__nv_bfloat16, 128, 32, 4, 4>" in geo.decode_kernel_name("bfloat16", 128, 32, 4)


# ---- argument checks run before any CUDA call ------------------------------------------------------------------
@pytest.fixture
def no_cuda(monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("a CUDA call was reached before the arguments were rejected")
    for name in ("launch", "num_sms", "device_arch", "get_kernel"):
        monkeypatch.setattr(kernels, name, reached)
        monkeypatch.setattr(kernel_build, name, reached)


def cache(dtype=torch.float16, blocks=4, bs=16, kv_heads=2, hd=64):
    return torch.zeros(blocks, bs, kv_heads, hd, dtype=dtype), torch.zeros(blocks, bs, kv_heads, hd, dtype=dtype)


def decode_args(**over):
    k, v = cache()
    args = dict(out=torch.zeros(3, 4, 64, dtype=torch.float16), query=torch.zeros(3, 4, 64, dtype=torch.float16),
                k_cache=k, v_cache=v, block_tables=torch.zeros(3, 4, dtype=torch.int32),
                context_lens=torch.ones(3, dtype=torch.int32), scale=0.125, context_lens_cpu=[1, 1, 1])
    args.update(over)
    return args


@pytest.mark.parametrize("over,arg", [
    (dict(query=torch.zeros(3, 4, 64, dtype=torch.float64)), "query"),
    (dict(query=torch.zeros(3, 3, 64, dtype=torch.float16)), "query"),          # 3 heads over 2 kv heads
    (dict(query=torch.zeros(3, 4, 128, dtype=torch.float16)[..., :64]), "query"),  # head_dim not dense
    (dict(query=torch.zeros(3, 4 * 64 + 4, dtype=torch.float16)[:, :256].view(3, 4, 64)), "query"),  # row stride
    (dict(k_cache=cache(torch.bfloat16)[0]), "k_cache"),
    (dict(k_cache=cache(bs=8)[0], v_cache=cache(bs=8)[1]), "k_cache"),
    (dict(k_cache=cache(hd=96)[0], v_cache=cache(hd=96)[1]), "k_cache"),
    (dict(v_cache=cache()[1].transpose(0, 1)), "v_cache"),
    (dict(out=torch.zeros(3, 4, 64, dtype=torch.float32)), "out"),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int64)), "block_tables"),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.int32)), "block_tables"),
    (dict(context_lens=torch.ones(3, 1, dtype=torch.int32)), "context_lens"),
    (dict(context_lens_cpu=[1]), "context_lens_cpu"),
    (dict(scale=0.0), "scale"),
    (dict(), "out"),  # all valid but on the CPU: the device check names the first tensor
])
def test_decode_rejects_before_cuda(no_cuda, over, arg):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        kernels.paged_decode_attention(**decode_args(**over))


def test_prefill_rejects_before_cuda(no_cuda):
    a = decode_args()
    a.pop("context_lens_cpu")
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)  # 2 sequences, but 3 asked for below
    with pytest.raises(ValueError, match="^query_start_loc"):
        kernels.paged_prefill_attention(**a, query_start_loc=qsl, seq_offset=1, num_prefill_seqs=2, max_query_len=1)
    with pytest.raises(ValueError, match="^query_start_loc"):
        kernels.paged_prefill_attention(**a, query_start_loc=qsl.long(), seq_offset=0, num_prefill_seqs=2,
                                        max_query_len=1)
    with pytest.raises(ValueError, match="^out"):
        kernels.paged_prefill_attention(**a, query_start_loc=qsl, seq_offset=0, num_prefill_seqs=2, max_query_len=1)


def test_cache_ops_reject_before_cuda(no_cuda):
    k, v = cache()
    key = torch.zeros(5, 2, 64, dtype=torch.float16)
    slots = torch.arange(5)
    with pytest.raises(ValueError, match="^key"):
        kernels.reshape_and_cache(key.float(), key, k, v, slots)
    with pytest.raises(ValueError, match="^value"):
        kernels.reshape_and_cache(key, key[:4], k, v, slots)
    with pytest.raises(ValueError, match="^slot_mapping"):
        kernels.reshape_and_cache(key, key, k, v, slots.int())
    with pytest.raises(ValueError, match="^k_cache"):
        kernels.reshape_and_cache(key, key, k[:, :, :1], v, slots)
    with pytest.raises(ValueError, match="^key"):
        kernels.reshape_and_cache(key, key, k, v, slots)  # valid, but on the CPU
    with pytest.raises(ValueError, match=r"^v_caches\[0\]"):
        kernels.copy_blocks([k], [v[:2]], torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="^block_mapping"):
        kernels.copy_blocks([k], [v], torch.zeros(1, 2, dtype=torch.int32))


def test_elementwise_reject_before_cuda(no_cuda):
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^weight"):
        kernels.rms_norm(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="^residual"):
        kernels.rms_norm(x, w, 1e-6, x.half())
    with pytest.raises(ValueError, match="^x"):
        kernels.rms_norm(x.t(), w[:4], 1e-6)
    with pytest.raises(ValueError, match="^x"):
        kernels.rms_norm(x, w, 1e-6)  # valid, but on the CPU
    q = torch.zeros(4, 2, 64, dtype=torch.float16)
    table = torch.zeros(16, 64)
    with pytest.raises(ValueError, match="^positions"):
        kernels.rotary_embedding(torch.arange(4, dtype=torch.int32), q, table)
    with pytest.raises(ValueError, match="^cos_sin_cache"):
        kernels.rotary_embedding(torch.arange(4), q, table.half())
    with pytest.raises(ValueError, match="^x"):
        kernels.rotary_embedding(torch.arange(4), torch.zeros(4, 2, 7, dtype=torch.float16), torch.zeros(16, 7))
    with pytest.raises(ValueError, match="^x"):
        kernels.silu_and_mul(torch.zeros(4, 7, dtype=torch.float16))
    with pytest.raises(ValueError, match="^x"):
        kernels.silu_and_mul(torch.zeros(4, 8, dtype=torch.int32))


def test_cuda_backend_rejects_bad_shapes(no_cuda):
    k, v = cache()
    meta = AttentionMetadata(
        slot_mapping=torch.arange(2), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=torch.tensor([2], dtype=torch.int32), query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        query_lens=torch.tensor([2], dtype=torch.int32), max_query_len=2, max_context_len=2, num_decode_seqs=0,
        query_lens_cpu=[2], context_lens_cpu=[2])
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError):
        CudaAttentionBackend().forward(q, q[:, :2], q[:, :2].float(), k, v, meta, 0.125)
    with pytest.raises(ValueError, match="^key"):  # shapes fine, CPU tensors: rejected by reshape_and_cache
        CudaAttentionBackend().forward(q, q[:, :2], q[:, :2], k, v, meta, 0.125)


def test_select_attention_backend_on_cpu():
    assert isinstance(select_attention_backend("torch", "cpu"), TorchAttentionBackend)
    assert isinstance(select_attention_backend("auto", "cpu"), TorchAttentionBackend)
    with pytest.raises(RuntimeError, match="cuda"):
        select_attention_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        select_attention_backend("flash", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="is_available"):
            select_attention_backend("cuda", "cuda")
        assert isinstance(select_attention_backend("auto", "cuda"), TorchAttentionBackend)
