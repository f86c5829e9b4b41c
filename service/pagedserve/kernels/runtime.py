"""Where the kernel launchers run: the :class:`KernelRuntime` interface, the CUDA implementation (the default) and
how to install another.

The launchers (:mod:`pagedserve.kernels.attention`, ``cache_ops``, ``elementwise``) check their arguments, plan the
launch and then ask the current runtime for everything device-specific: which device the tensors are on, the SM
count (reported; no plan uses it), the architecture a module is compiled for, the pointer passed for a tensor, and the
launch itself. The host emulator in tests/simt implements the same interface for CPU tensors, so the launchers run
unchanged on it::

    with use_runtime(Simulator()):
        kernels.paged_decode_attention(...)   # on CPU tensors, through the emulator

A runtime is installed for the whole process (the engine launches from its own thread), not per thread.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .build import ModuleKey
from .checks import check_cuda
from .launch import cuda_device_arch, cuda_launch, cuda_num_sms


@runtime_checkable
class KernelRuntime(Protocol):
    """What the launchers need from a device."""

    def check_device(self, **tensors: torch.Tensor) -> torch.device:
        """All ``tensors`` (keyword: argument name) are on one device this runtime runs; returns it. Raises
        ValueError naming the first offender."""

    def num_sms(self, index: int | None) -> int:
        """Streaming multiprocessors of device ``index`` (for information: no plan depends on it, since the decode
        kernel's split-K partitions are fixed)."""

    def device_arch(self, index: int | None) -> str:
        """The architecture modules are built for on device ``index`` (``"sm_90"``; :attr:`ModuleKey.arch`)."""

    def pointer(self, t: torch.Tensor) -> np.uint64:
        """Tensor ``t`` as a kernel pointer argument (its data address)."""

    def launch(self, key: ModuleKey, name: str, device: torch.device, grid, block, args,
               smem_bytes: int = 0) -> None:
        """Run template instantiation ``name`` of module ``key`` with this geometry and argument tuple (numpy
        scalars, pointers from :meth:`pointer`) and ``smem_bytes`` of dynamic shared memory."""


class CudaRuntime:
    """The default runtime: CUDA tensors, modules compiled with NVRTC through CuPy, launched on torch's current
    stream."""

    def check_device(self, **tensors: torch.Tensor) -> torch.device:
        return check_cuda(**tensors)

    def num_sms(self, index: int | None) -> int:
        return cuda_num_sms(index)

    def device_arch(self, index: int | None) -> str:
        return cuda_device_arch(index)

    def pointer(self, t: torch.Tensor) -> np.uint64:
        return np.uint64(t.data_ptr())

    def launch(self, key: ModuleKey, name: str, device: torch.device, grid, block, args,
               smem_bytes: int = 0) -> None:
        cuda_launch(key, name, device, grid, block, args, smem_bytes)


_default = CudaRuntime()
_current: KernelRuntime = _default
_lock = threading.Lock()


def current_runtime() -> KernelRuntime:
    """The runtime the launchers use now."""
    return _current


@contextlib.contextmanager
def use_runtime(runtime: KernelRuntime) -> Iterator[KernelRuntime]:
    """Install ``runtime`` for the whole process inside the block (nesting restores the previous one)."""
    global _current
    if not isinstance(runtime, KernelRuntime):
        raise TypeError(f"runtime: {type(runtime).__name__} does not implement KernelRuntime")
    with _lock:
        previous, _current = _current, runtime
    try:
        yield runtime
    finally:
        with _lock:
            _current = previous


def num_sms(index: int | None) -> int:
    """SM count of device ``index`` as the current runtime reports it."""
    return _current.num_sms(index)


def device_arch(index: int | None) -> str:
    """Architecture of device ``index`` as the current runtime reports it."""
    return _current.device_arch(index)


def module_key(runtime: KernelRuntime, device: torch.device, family: str, dtype: str | None = None,
               head_dim: int | None = None, block_size: int | None = None) -> ModuleKey:
    """:class:`ModuleKey` of ``family`` for ``device``'s architecture under ``runtime``."""
    return ModuleKey(family, dtype, head_dim, block_size, runtime.device_arch(device.index))
