"""Launcher argument checks (they must reject bad inputs before any CUDA call, naming the argument), backend
selection on a CPU-only machine, and every launch's arguments against its kernel's C++ signature."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagedserve import kernels
from pagedserve.attention import TorchAttentionBackend, select_attention_backend
from pagedserve.attention.base import AttentionMetadata
from pagedserve.attention.cuda import CudaAttentionBackend
from pagedserve.kernels import CudaRuntime, KernelRuntime, ModuleKey, use_runtime
from pagedserve.kernels import geometry as geo


class NoCudaRuntime(CudaRuntime):
    """The CUDA runtime's device check; anything that would touch CUDA fails the test."""

    def _reached(self, *args, **kwargs):
        raise AssertionError("a CUDA call was reached before the arguments were rejected")

    launch = num_sms = device_arch = pointer = _reached


class RecordingRuntime:
    """Runs launchers to the launch on CPU tensors (an sm_90 with 132 SMs) and records each launch."""

    def __init__(self):
        self.calls = []

    def check_device(self, **tensors):
        return torch.device("cpu")

    def num_sms(self, index):
        return 132

    def device_arch(self, index):
        return "sm_90"

    def pointer(self, t):
        return np.uint64(t.data_ptr())

    def launch(self, key, name, device, grid, block, args, smem_bytes=0):
        self.calls.append((key, name, grid, block, args, smem_bytes))


@pytest.fixture
def no_cuda():
    with use_runtime(NoCudaRuntime()):
        yield


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


# ---- every launcher's arguments match its kernel's C++ signature -------------------------------------------------
C_TYPES = {"ptr": np.uint64, "long long": np.int64, "int": np.int32, "float": np.float32}


def kernel_signature(family: str, name: str) -> list[type]:
    """Parameter types of kernel template ``name`` parsed from its source."""
    src = kernels.load_source(ModuleKey(family, "float32" if "fp32" in name else None).source_file)
    base = name.split("<")[0]
    match = re.search(rf"\b{base}\s*\(([^)]*)\)\s*\{{", src)
    assert match, f"{base} not found in {family}"
    types = []
    for param in match.group(1).split(","):
        words = param.replace("__restrict__", "").replace("const", "").split()
        ctype = "ptr" if "*" in param else " ".join(words[:-1])
        types.append(C_TYPES[ctype])
    return types


@pytest.fixture
def recorded_launches():
    """Launchers run to the launch on CPU tensors; each launch is recorded instead of run."""
    with use_runtime(RecordingRuntime()) as runtime:
        yield runtime.calls


def test_runtimes_implement_the_interface():
    assert isinstance(kernels.current_runtime(), CudaRuntime)  # the default
    assert isinstance(RecordingRuntime(), KernelRuntime) and isinstance(NoCudaRuntime(), KernelRuntime)
    with pytest.raises(TypeError, match="runtime"):
        with use_runtime(object()):
            pass
    outer, inner = RecordingRuntime(), RecordingRuntime()
    with use_runtime(outer):
        with use_runtime(inner):
            assert kernels.current_runtime() is inner and kernels.num_sms(0) == 132
        assert kernels.current_runtime() is outer and kernels.device_arch(0) == "sm_90"
    assert isinstance(kernels.current_runtime(), CudaRuntime)


def test_launch_arguments_match_kernel_signatures(recorded_launches):
    a = decode_args(context_lens_cpu=[1, 5000, 3])  # long enough to split: decode + merge launches
    kernels.paged_decode_attention(**a)
    a.pop("context_lens_cpu")
    kernels.paged_prefill_attention(**a, query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                                    seq_offset=1, num_prefill_seqs=2, max_query_len=1)
    f32 = decode_args(query=torch.zeros(3, 4, 64), out=torch.zeros(3, 4, 64), k_cache=cache(torch.float32)[0],
                      v_cache=cache(torch.float32)[1])
    f32.pop("context_lens_cpu")
    kernels.paged_prefill_attention(**f32, query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                                    seq_offset=0, num_prefill_seqs=3, max_query_len=1)
    k, v = cache()
    kernels.reshape_and_cache(torch.zeros(5, 2, 64, dtype=torch.float16), torch.zeros(5, 2, 64, dtype=torch.float16),
                              k, v, torch.arange(5))
    kernels.copy_blocks([k, k], [v, v], torch.tensor([[0, 1]]))
    x = torch.zeros(4, 576, dtype=torch.bfloat16)
    kernels.rms_norm(x, torch.ones(576, dtype=torch.bfloat16), 1e-6, x)
    kernels.rms_norm(x, torch.ones(576, dtype=torch.bfloat16), 1e-6)
    kernels.rotary_embedding(torch.arange(4), torch.zeros(4, 2, 64), torch.zeros(8, 64), is_neox=False)
    kernels.silu_and_mul(torch.zeros(4, 14, dtype=torch.float16))
    names = [c[1].split("<")[0] for c in recorded_launches]
    assert names == ["paged_decode_kernel", "paged_decode_merge_kernel", "paged_prefill_kernel",
                     "paged_prefill_fp32_kernel", "reshape_and_cache_kernel", "copy_blocks_kernel",
                     "rms_norm_kernel", "rms_norm_kernel", "rotary_embedding_kernel", "silu_and_mul_kernel"]
    for key, name, grid, block, args, smem in recorded_launches:
        assert [type(x) for x in args] == kernel_signature(key.family, name), name
        assert name in key.name_expressions(), f"{name} is not instantiated in {key}"
        assert len(grid) == 3 and len(block) == 3 and all(d >= 1 for d in (*grid, *block))
    decode, merge, prefill, prefill_fp32 = recorded_launches[:4]
    assert decode[5] == geo.decode_smem_bytes("float16", 64, 16, 2) > 0  # the ring's dynamic shared memory
    assert decode[2][0] == 20 and merge[5] == 0  # 256-token partitions of 5000 tokens; the merge's state in registers
    assert prefill[5] == geo.plan_prefill("float16", 64, 4, 2, 1).smem_bytes > 0
    assert prefill_fp32[5] == geo.plan_prefill("float32", 64, 4, 3, 1, 2, 16).smem_bytes > 0
