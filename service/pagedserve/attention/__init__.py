"""Attention backends: the torch reference (any device) and the CUDA kernels (CuPy RawModule).

:func:`select_attention_backend` maps ``--attention-backend auto|cuda|torch`` to an instance; the engine and the
model code only see the :class:`~pagedserve.attention.base.AttentionBackend` interface.
"""
from __future__ import annotations

import torch

from .base import AttentionBackend, AttentionMetadata
from .torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "select_attention_backend"]

BACKEND_NAMES = ("auto", "cuda", "torch")


def select_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The attention backend called ``name`` for a model on ``device``.

    ``"torch"`` always works. ``"cuda"`` needs a CUDA device that torch sees, CuPy, and a working NVRTC compile;
    ``"auto"`` picks cuda when all of that holds and torch otherwise.

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
        return TorchAttentionBackend()
    from .cuda import CudaAttentionBackend, cuda_backend_error
    error = cuda_backend_error(device)
    if error is None:
        return CudaAttentionBackend()
    if name == "cuda":
        raise RuntimeError(f"attention_backend 'cuda' is unusable: {error}")
    return TorchAttentionBackend()
