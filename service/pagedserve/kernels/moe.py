"""Launchers of cuda/moe.cu: a mixture-of-experts layer's router top-k and the weighted sum of its experts' outputs
(the CUDA path of :class:`pagedserve.models.moe.SparseMoeBlock`, which keeps the torch references; the experts'
matmuls stay torch GEMMs). CUDA tensors, or CPU tensors under the host emulator's runtime; arguments are checked
before the runtime sees them."""
from __future__ import annotations

import numpy as np
import torch

from . import geometry as geo
from .checks import check_tensor
from .runtime import current_runtime, module_key


def moe_topk(logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Router top-k (HF ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter`` with ``softmax_first``: softmax over every
    expert in float32, the top ``top_k``, renormalized to sum 1 when ``renormalize``; ``GptOssTopKRouter``
    without: the top ``top_k`` logits, softmax over those).

    Args:
        logits: ``[T, E]`` float32, contiguous (the router bias already added).
    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int32)``, by descending weight (ties: the lower expert).
    Raises:
        ValueError: naming ``logits`` or ``top_k`` (outside ``1..min(E, 64)``).
    """
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2, contiguous=True)
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= min(num_experts, geo.MOE_MAX_TOP_K):
        raise ValueError(f"top_k: must be within 1..{min(num_experts, geo.MOE_MAX_TOP_K)}, got {top_k}")
    rt = current_runtime()
    device = rt.check_device(logits=logits)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens:
        warps = geo.MOE_TOPK_WARPS
        grid = ((num_tokens + warps - 1) // warps, 1, 1)
        args = (rt.pointer(weights), rt.pointer(ids), rt.pointer(logits), np.int32(num_tokens),
                np.int32(num_experts), np.int32(top_k), np.int32(int(renormalize)))
        rt.launch(module_key(rt, device, "moe", "float32"), geo.moe_topk_kernel_name(softmax_first), device, grid,
                  (32 * warps, 1, 1), args)
    return weights, ids


def moe_combine(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j src[rows[t, j]]`` in the order of ``rows[t]``, accumulated in float32, rounded once to
    ``src``'s dtype (models/moe.py adds in ascending expert order; give ``rows`` in that order).

    Args:
        src: ``[P, hidden]`` float16 / bfloat16 / float32, contiguous: each (token, expert) pair's output, already
            multiplied by its routing weight.
        rows: ``[T, top_k]`` int32, contiguous, each in ``0..P-1``.
    Returns:
        ``[T, hidden]`` of ``src``'s dtype.
    Raises:
        ValueError: naming ``src`` or ``rows``.
    """
    dtype = geo.dtype_name(src.dtype, "src")
    check_tensor("src", src, ndim=2, contiguous=True)
    check_tensor("rows", rows, dtypes=(torch.int32,), ndim=2, contiguous=True)
    rt = current_runtime()
    device = rt.check_device(src=src, rows=rows)
    num_tokens, top_k = rows.shape
    hidden = src.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=src.dtype, device=device)
    if num_tokens and hidden:
        threads = min(1024, max(32, (hidden + 31) // 32 * 32))
        args = (rt.pointer(out), rt.pointer(src), rt.pointer(rows), np.int32(hidden), np.int32(top_k))
        rt.launch(module_key(rt, device, "moe", dtype), geo.moe_combine_kernel_name(dtype), device,
                  (num_tokens, (hidden + threads - 1) // threads, 1), (threads, 1, 1), args)
    return out
