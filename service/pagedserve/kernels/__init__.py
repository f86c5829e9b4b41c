"""The CUDA kernels of ``cuda/``: compiled at run time with NVRTC through ``cupy.RawModule`` and launched on torch
tensors (by data pointer, no copies) on torch's current CUDA stream.

Every launcher checks dtype, shape, strides, alignment and device first and raises :class:`ValueError` naming the
argument before any CUDA call. The torch references the kernels must match are
:mod:`pagedserve.attention.torch_ref` and :mod:`pagedserve.kernels.elementwise_ref`.

Modules:
    geometry     supported dtypes and sizes, template names, launch plans (pure Python)
    checks       argument checks of the launchers
    sources      where the ``.cu``/``.cuh`` sources are (package data), reading one with its includes inlined
    build        ModuleKey, NVRTC options and CUDA headers, the per-process module cache
    cubin        compiling to CUBIN for a named architecture without a GPU (ptxas resource report)
    launch       the CUDA launch: torch's stream as a CuPy stream, SM count, architecture
    runtime      the KernelRuntime interface, CudaRuntime (default), use_runtime() to install another
    cache_ops, attention, elementwise    the public launchers (and CUDA_OPS, the elementwise set)
"""
from .attention import paged_decode_attention, paged_prefill_attention
from .build import KernelCompileError, ModuleKey, cuda_include_dirs, nvrtc_available, nvrtc_options
from .cache_ops import copy_blocks, reshape_and_cache
from .cubin import CubinResult, compile_to_cubin
from .elementwise import CUDA_OPS, rms_norm, rotary_embedding, silu_and_mul
from .geometry import DecodePlan, plan_decode, plan_decode_fixed
from .runtime import CudaRuntime, KernelRuntime, current_runtime, device_arch, num_sms, use_runtime
from .sources import find_source_dir, load_source

__all__ = [
    "CUDA_OPS", "CubinResult", "CudaRuntime", "DecodePlan", "KernelCompileError", "KernelRuntime", "ModuleKey",
    "compile_to_cubin", "copy_blocks", "cuda_include_dirs", "current_runtime", "device_arch", "find_source_dir",
    "load_source", "num_sms", "nvrtc_available", "nvrtc_options", "paged_decode_attention",
    "paged_prefill_attention", "plan_decode", "plan_decode_fixed", "reshape_and_cache", "rms_norm",
    "rotary_embedding", "silu_and_mul", "use_runtime",
]
