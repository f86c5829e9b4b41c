"""Attention backends: the torch reference (any device), the CPU backend (the reference with decodes on a C++ kernel)
and the CUDA kernels (CuPy RawModule).

:func:`select_attention_backend` maps ``--attention-backend auto|cpu|cuda|torch`` to an instance; the engine and the
model code only see the :class:`~pagedserve.attention.base.AttentionBackend` interface.
"""
from __future__ import annotations

import torch

from .base import AttentionBackend, AttentionMetadata
from .torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_attention_backend"]

BACKEND_NAMES = ("auto", "cpu", "cuda", "torch")


def select_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The attention backend called ``name`` for a model on ``device``.

    ``"torch"`` always works. ``"cpu"`` (a CPU device) runs decodes on the C++ kernel where it loads (else it is
    the reference throughout). ``"cuda"`` needs a CUDA device that torch sees, CuPy, and a working NVRTC compile;
    ``"auto"`` picks cuda when all of that holds, cpu on a CPU device where the C++ kernel loads, and torch
    otherwise.

    Raises:
        ValueError: unknown ``name``.
        RuntimeError: ``"cuda"`` requested but unusable (the message says why).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend: unknown backend {name!r}, expected one of {BACKEND_NAMES}")
    if name == "torch":
        return TorchAttentionBackend()
    if torch.device(device).type != "cuda":
        if name == "cuda":
            raise RuntimeError(f"attention_backend 'cuda' needs a CUDA device, got {device}")
        from .cpu import CpuAttentionBackend, cpu_decode_kernel_available
        if name == "cpu" or (torch.device(device).type == "cpu" and cpu_decode_kernel_available()):
            return CpuAttentionBackend()
        return TorchAttentionBackend()
    if name == "cpu":
        raise RuntimeError(f"attention_backend 'cpu' needs a CPU device, got {device}")
    from .cuda import CudaAttentionBackend, cuda_backend_error
    error = cuda_backend_error(device)
    if error is None:
        return CudaAttentionBackend()
    if name == "cuda":
        raise RuntimeError(f"attention_backend 'cuda' is unusable: {error}")
    return TorchAttentionBackend()
