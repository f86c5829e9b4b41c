"""Launching compiled kernels on a CUDA GPU (the :class:`pagedserve.kernels.runtime.CudaRuntime`'s half): torch's
current CUDA stream as a CuPy stream, the device's architecture and SM count, and the launch itself (with the
dynamic shared-memory opt-in)."""
from __future__ import annotations

import functools

import torch

from .build import ModuleKey, get_kernel

_DEFAULT_SMEM_LIMIT = 48 * 1024


class _StreamHandle:
    """Minimal CUDA-stream-protocol object around a raw ``cudaStream_t``."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


_streams: dict[tuple[int, int], object] = {}


def _cupy_stream(device: torch.device):
    """CuPy view of torch's current stream on ``device`` (cached per raw stream handle)."""
    import cupy
    ptr = torch.cuda.current_stream(device).cuda_stream
    stream = _streams.get((device.index, ptr))
    if stream is None:
        if hasattr(cupy.cuda.Stream, "from_external"):
            stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        else:  # CuPy < 14
            stream = cupy.cuda.ExternalStream(ptr, device.index)
        _streams[(device.index, ptr)] = stream
    return stream


@functools.cache
def cuda_device_arch(index: int) -> str:
    """``sm_XY`` of CUDA device ``index``."""
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@functools.cache
def cuda_num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_launch(key: ModuleKey, name: str, device: torch.device, grid, block, args, smem_bytes: int = 0) -> None:
    """Launch template ``name`` of module ``key`` on torch's current stream of ``device`` (a CUDA
    ``torch.device``). When ``smem_bytes`` exceeds 48 KiB it first raises the kernel's dynamic shared-memory limit
    and asks for the largest shared-memory carveout (these kernels stage global data with cp.async.cg, which
    bypasses L1, so the carveout buys resident blocks)."""
    import cupy
    with cupy.cuda.Device(device.index):
        kernel = get_kernel(key, name)
        if smem_bytes > _DEFAULT_SMEM_LIMIT and kernel.max_dynamic_shared_size_bytes < smem_bytes:
            kernel.max_dynamic_shared_size_bytes = smem_bytes
            kernel.preferred_shared_memory_carveout = 100
        with _cupy_stream(device):
            kernel(tuple(grid), tuple(block), tuple(args), shared_mem=smem_bytes)
