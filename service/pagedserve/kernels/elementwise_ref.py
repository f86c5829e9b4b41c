"""Reference (torch) versions of the model's fused elementwise ops; the CUDA kernels in cuda/ must match these.

All functions are pure (return new tensors) and accept any float dtype; statistics are taken in fp32.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019; HF LlamaRMSNorm semantics), optionally fused with a residual add.

    Args:
        x: ``[T, hidden]``.
        weight: ``[hidden]``.
        eps: added to the mean square.
        residual: ``[T, hidden]`` or None. When given, ``x + residual`` is normalized.

    Returns:
        ``(normed, new_residual)``: ``normed = weight * h / sqrt(mean(h^2) + eps)`` with ``h = x (+ residual)``, in
        x's dtype, and ``new_residual = h`` (the un-normalized sum, for the next residual add).
    """
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype), h


def rotary_cos_sin_cache(head_dim: int, max_position: int, base: float,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """Rotary embedding table (Su et al., RoFormer 2021): ``[max_position, head_dim]`` fp32, cos in the first half
    of the last dim and sin in the second, for frequencies ``base ** (-2i / head_dim)``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return cos_sin_table(inv_freq, max_position, device)


def cos_sin_table(inv_freq: torch.Tensor, max_position: int, device: torch.device | str = "cpu",
                  scale: float = 1.0) -> torch.Tensor:
    """``[max_position, 2 * len(inv_freq)]`` fp32: ``scale * cos(p * inv_freq)`` in the first half of the last dim
    and ``scale * sin(p * inv_freq)`` in the second, computed in float64 (the layout :func:`rotary_embedding`
    reads; ``inv_freq`` from any rope type, see :mod:`pagedserve.models.rope`)."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq.double())
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    if scale != 1.0:
        table = table * scale
    return table.to(device=device, dtype=torch.float32)


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> torch.Tensor:
    """Apply rotary position embedding to ``x``.

    Args:
        positions: ``[T]`` int64 absolute positions.
        x: ``[T, num_heads, head_dim]``.
        cos_sin_cache: from :func:`rotary_cos_sin_cache`.
        is_neox: True rotates the two halves of head_dim (GPT-NeoX / HF Llama ``rotate_half``); False rotates
            interleaved pairs (GPT-J, original Meta Llama).

    Returns:
        ``[T, num_heads, head_dim]`` in x's dtype.
    """
    half = x.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)            # [T, head_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]          # [T, 1, half]
    xf = x.float()
    if is_neox:
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020): ``x`` is ``[T, 2 * d]`` holding gate then up; returns ``silu(gate) * up``,
    ``[T, d]``."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU activation (Shazeer 2020) with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``): ``x``
    ``[T, 2 * d]`` holding gate then up; returns ``gelu_tanh(gate) * up``, ``[T, d]``."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


@dataclass(frozen=True, slots=True)
class ElementwiseOps:
    """One implementation of the model's elementwise layers. The attention backend carries the set that runs with
    it (:attr:`pagedserve.attention.base.AttentionBackend.elementwise`), so the model code never names a device:
    :data:`TORCH_OPS` (the references above, any device), :data:`pagedserve.kernels.CUDA_OPS` (the kernels of
    cuda/elementwise.cu) or :data:`pagedserve.kernels.cpu_elementwise.CPU_OPS` (the C++ kernels of
    kernels/csrc/elementwise.cpp). ``traceable``: whether dynamo can trace them (torch ops or registered custom
    ops with fake implementations), so that the compiled forward may run them."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    traceable: bool = True
    #: GeGLU; every set runs the torch reference (no kernel of ours yet)
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul


TORCH_OPS = ElementwiseOps("torch", rms_norm, rotary_embedding, silu_and_mul)
