"""The model's elementwise layers on pagedserve's C++ CPU kernels (``kernels/csrc/elementwise.cpp``).

:data:`CPU_OPS` runs with :class:`pagedserve.attention.cpu.CpuAttentionBackend`. Each function takes the arguments
of its reference in :mod:`.elementwise_ref` and returns the same result (float32 rounding aside: one fused pass in a
different summation order; RMSNorm within 1e-6 relative, SiLU's exp within 2e-7 relative): float32 CPU tensors of
the shapes the kernels handle go to ``torch.ops.pagedserve_cpu``, anything else (other dtypes, devices, odd widths,
the kernels not loaded) to the reference. Why: at one decode token the reference's chain of small torch ops
(pow, mean, rsqrt, mul, index_select, cat, silu...) costs about 20 dispatches per layer, ~10 ms of a 55 ms step.
"""
from __future__ import annotations

import torch

from . import elementwise_ref as ops
from .cpu_build import cpu_kernel_ops


def _loaded() -> bool:
    # Under torch.compile the library is loaded already (the CPU backend, the only user that compiles, needs it),
    # and dynamo cannot trace cpu_kernel_ops()'s lock (which, once loaded, it does not take).
    return torch.compiler.is_compiling() or cpu_kernel_ops() is not None


def _fits(x: torch.Tensor, multiple: int) -> bool:
    return x.dtype == torch.float32 and x.is_cpu and x.shape[-1] % multiple == 0 and x.stride(-1) == 1 and _loaded()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.elementwise_ref.rms_norm` (HF LlamaRMSNorm, optional fused residual add): ``x`` ``[T, hidden]``,
    ``weight`` ``[hidden]``, ``residual`` ``[T, hidden]`` or None; returns ``(normed, x + residual)`` (``x`` itself
    without a residual), float32."""
    if x.dim() != 2 or not _fits(x, 8) or weight.dtype != torch.float32 or \
            (residual is not None and (residual.shape != x.shape or not _fits(residual, 8))):
        return ops.rms_norm(x, weight, eps, residual)
    normed, h = torch.ops.pagedserve_cpu.rms_norm(x, weight.contiguous(), float(eps), residual)
    return normed, (x if residual is None else h)


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> torch.Tensor:
    """:func:`.elementwise_ref.rotary_embedding` (RoFormer): ``x`` ``[T, heads, head_dim]`` (rows and heads may be
    strided views of a fused QKV output), ``positions`` int64 ``[T]``; returns a new contiguous
    ``[T, heads, head_dim]``.

    Raises:
        RuntimeError: a position outside the table (the reference's index_select raises IndexError).
    """
    if x.dim() != 3 or not _fits(x, 16) or cos_sin_cache.dtype != torch.float32 or positions.dtype != torch.int64:
        return ops.rotary_embedding(positions, x, cos_sin_cache, is_neox)
    return torch.ops.pagedserve_cpu.rotary_embedding(positions, x, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`.elementwise_ref.silu_and_mul` (SwiGLU): ``x`` ``[T, 2 * d]`` (gate | up) -> ``[T, d]``."""
    if x.dim() != 2 or not _fits(x, 16):
        return ops.silu_and_mul(x)
    return torch.ops.pagedserve_cpu.silu_and_mul(x)


#: The C++ elementwise set (registered custom ops with fake implementations, so the compiled forward traces them).
CPU_OPS = ops.ElementwiseOps("cpu", rms_norm, rotary_embedding, silu_and_mul, traceable=True)
