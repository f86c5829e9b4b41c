"""Launchers of cuda/elementwise.cu: the model's fused elementwise layers, with the same signatures and results as
the torch references in :mod:`.elementwise_ref` (CUDA tensors only), and :data:`CUDA_OPS`, the set an attention
backend carries. Arguments are checked (:mod:`pagedserve.kernels.checks`) before the current runtime sees them."""
from __future__ import annotations

import numpy as np
import torch

from . import geometry as geo
from .elementwise_ref import ElementwiseOps
from .checks import check_tensor
from .runtime import current_runtime, module_key


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA :func:`.elementwise_ref.rms_norm`: ``x`` ``[..., hidden]`` (last dim contiguous), ``weight``
    ``[hidden]`` and optional ``residual`` like ``x``, one dtype. Returns ``(normed, x + residual)`` (or
    ``(normed, x)`` without residual), new contiguous tensors except that second ``x``."""
    dtype = geo.dtype_name(x.dtype, "x")
    check_tensor("x", x, inner_contiguous=1)
    hidden = x.shape[-1]
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=1, shape=(hidden,), contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape), ndim=x.dim(), inner_contiguous=1)
    if x.dim() < 1 or hidden == 0:
        raise ValueError(f"x: need a non-empty last dim, got shape {tuple(x.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    tensors = {"x": x, "weight": weight} | ({"residual": residual} if residual is not None else {})
    rt = current_runtime()
    ptr = rt.pointer
    device = rt.check_device(**tensors)
    x2 = x.reshape(-1, hidden)
    r2 = residual.reshape(-1, hidden) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=x.dtype, device=device)
    res_out = torch.empty_like(out) if residual is not None else out
    if x2.shape[0]:
        es = x.element_size()
        vec = geo.vec_for_rows(dtype, hidden, x2.data_ptr(), x2.stride(0) * es, r2.data_ptr(), r2.stride(0) * es,
                               weight.data_ptr())
        g = geo.plan_rows(x2.shape[0], hidden // vec)
        args = (ptr(out), ptr(res_out), ptr(x2), ptr(r2), ptr(weight), np.int64(x2.stride(0)),
                np.int64(r2.stride(0)), np.int32(hidden), np.float32(eps))
        name = geo.rms_norm_kernel_name(dtype, vec, residual is not None)
        rt.launch(module_key(rt, device, "elementwise", dtype), name, device, g.grid, g.block, args)
    new_residual = res_out.view(x.shape) if residual is not None else x
    return out.view(x.shape), new_residual


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> torch.Tensor:
    """CUDA :func:`.elementwise_ref.rotary_embedding`: ``positions`` ``[T]`` int64 (each < max_position, not
    checked), ``x`` ``[T, num_heads, head_dim]`` (head_dim contiguous, any token/head strides), ``cos_sin_cache``
    ``[max_position, head_dim]`` fp32 contiguous. Returns a new contiguous ``[T, num_heads, head_dim]``."""
    dtype = geo.dtype_name(x.dtype, "x")
    check_tensor("x", x, ndim=3, inner_contiguous=1)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: head_dim must be even, got {head_dim}")
    check_tensor("positions", positions, dtypes=(torch.int64,), ndim=1, shape=(num_tokens,), contiguous=True)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), ndim=2, shape=(None, head_dim),
                 contiguous=True)
    rt = current_runtime()
    ptr = rt.pointer
    device = rt.check_device(positions=positions, x=x, cos_sin_cache=cos_sin_cache)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=device)
    if num_tokens and num_heads:
        g = geo.plan_rows(num_tokens, num_heads * head_dim // 2, max_threads=512)
        args = (ptr(out), ptr(x), ptr(positions), ptr(cos_sin_cache), np.int64(x.stride(0)),
                np.int64(x.stride(1)), np.int32(num_heads), np.int32(head_dim))
        rt.launch(module_key(rt, device, "elementwise", dtype), geo.rotary_kernel_name(dtype, is_neox), device,
                  g.grid, g.block, args)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """CUDA :func:`.elementwise_ref.silu_and_mul`: ``x`` ``[..., 2 * d]`` (last dim contiguous) to a new
    ``[..., d]`` holding ``silu(x[..., :d]) * x[..., d:]``."""
    dtype = geo.dtype_name(x.dtype, "x")
    check_tensor("x", x, inner_contiguous=1)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even (gate then up), got shape {tuple(x.shape)}")
    rt = current_runtime()
    ptr = rt.pointer
    device = rt.check_device(x=x)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=device)
    if x2.shape[0] and d:
        es = x.element_size()
        vec = geo.vec_for_rows(dtype, d, x2.data_ptr(), x2.stride(0) * es, d * es)
        g = geo.plan_silu_and_mul(x2.shape[0], d // vec)
        args = (ptr(out), ptr(x2), np.int64(x2.stride(0)), np.int32(d))
        rt.launch(module_key(rt, device, "elementwise", dtype), geo.silu_and_mul_kernel_name(dtype, vec), device,
                  g.grid, g.block, args)
    return out.view(*x.shape[:-1], d)


CUDA_OPS = ElementwiseOps("cuda", rms_norm, rotary_embedding, silu_and_mul, traceable=False)
