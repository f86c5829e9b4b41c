"""Argument checks of the kernel launchers: each raises :class:`ValueError` naming the offending argument, and all
run before any CUDA call. Which device the tensors must be on is the runtime's call
(:meth:`pagedserve.kernels.runtime.KernelRuntime.check_device`); :func:`check_cuda` is the CUDA runtime's."""
from __future__ import annotations

import math

import torch

from . import geometry as geo


def check_tensor(name: str, t, *, dtypes=None, ndim: int | None = None, shape: tuple | None = None,
                 contiguous: bool = False, inner_contiguous: int = 0) -> None:
    """Raise ValueError naming ``name`` unless ``t`` is a tensor with the wanted dtype, rank, shape and layout.

    ``shape`` entries that are None are not checked. ``inner_contiguous=k`` requires the last ``k`` dims to be
    laid out densely (row strides of the leading dims are free). No device check here (see ``check_cuda``).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not in {tuple(str(d) for d in dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and any(w is not None and w != s for w, s in zip(shape, t.shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")
    if inner_contiguous:
        expected = 1
        for dim in range(t.dim() - 1, t.dim() - 1 - inner_contiguous, -1):
            if t.shape[dim] != 1 and t.stride(dim) != expected:
                raise ValueError(f"{name}: the last {inner_contiguous} dims must be dense, got strides {t.stride()}")
            expected *= t.shape[dim]


def check_aligned(name: str, t: torch.Tensor, row_stride_dim: int | None = 0, align: int = 16) -> None:
    """Vectorised kernels need the data pointer (and the row stride, in bytes) to be ``align``-byte aligned."""
    if t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
    if row_stride_dim is None or t.dim() <= row_stride_dim:
        return
    if (t.stride(row_stride_dim) * t.element_size()) % align:
        raise ValueError(f"{name}: row stride must be a multiple of {align} bytes, got {t.stride()}")


def check_cuda(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one CUDA device; returns it. Raises ValueError naming the first offender."""
    device = None
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device} like the other arguments")
    return device


def check_cache_shape(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """Validate a paged K/V cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    check_tensor("k_cache", k_cache, dtypes=(dtype,), ndim=4, contiguous=True)
    check_tensor("v_cache", v_cache, dtypes=(dtype,), shape=tuple(k_cache.shape), contiguous=True)
    _, block_size, _, head_dim = k_cache.shape
    if block_size not in geo.SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"k_cache: block_size {block_size} not in {geo.SUPPORTED_BLOCK_SIZES}")
    if head_dim not in geo.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"k_cache: head_dim {head_dim} not in {geo.SUPPORTED_HEAD_DIMS}")
    check_aligned("k_cache", k_cache, None)
    check_aligned("v_cache", v_cache, None)
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"query: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def log2e_scale(scale: float) -> float:
    """Softmax scale folded with log2(e): the kernels use exp2."""
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale: must be a positive finite float, got {scale}")
    return float(scale) * math.log2(math.e)


def check_softcap_sinks(softcap: float | None, sinks: torch.Tensor | None, num_heads: int) -> None:
    """Raises ValueError: ``softcap`` not None and not a finite number > 0, or ``sinks`` not ``[num_heads]``
    floats (one logit per query head)."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap: {softcap!r} must be None or a finite number > 0")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (num_heads,)
                              or not sinks.dtype.is_floating_point):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks: expected a float tensor [{num_heads}] (one logit per query head), got {shape}")


def softcap_sinks_log2(softcap: float | None, sinks: torch.Tensor | None, num_heads: int, device
                      ) -> tuple[float, torch.Tensor | None]:
    """``(softcap * log2(e) or 0, sinks * log2(e) as contiguous float32 [num_heads] on device, or None)``: the
    kernels' log2-domain forms of a soft-cap and of attention sinks.

    Raises:
        ValueError: see :func:`check_softcap_sinks`.
    """
    check_softcap_sinks(softcap, sinks, num_heads)
    if sinks is not None:
        sinks = (sinks.to(device=device, dtype=torch.float32) * math.log2(math.e)).contiguous()
    return (0.0 if softcap is None else float(softcap) * math.log2(math.e)), sinks


def check_attention(out, query, k_cache, v_cache, block_tables, context_lens, num_seqs: int):
    """Shared checks of the decode and prefill launchers; returns (dtype name, cache shape)."""
    dtype = geo.dtype_name(query.dtype, "query")
    cache_shape = check_cache_shape(k_cache, v_cache, query.dtype)
    _, _, num_kv_heads, head_dim = cache_shape
    check_tensor("query", query, ndim=3, shape=(None, None, head_dim), inner_contiguous=2)
    check_heads(query.shape[1], num_kv_heads)
    check_tensor("out", out, dtypes=(query.dtype,), shape=tuple(query.shape), ndim=3, inner_contiguous=2)
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, shape=(None, None))
    if block_tables.shape[0] < num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: need >= {num_seqs} rows with unit column stride, got shape "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if context_lens.shape[0] < num_seqs:
        raise ValueError(f"context_lens: need >= {num_seqs} entries, got {context_lens.shape[0]}")
    check_aligned("query", query)
    check_aligned("out", out, align=4)
    return dtype, cache_shape


def check_sliding_window(sliding_window: int | None) -> int:
    """The window as the kernels take it: 0 for None (no window), else ``sliding_window``.

    Raises:
        ValueError: ``sliding_window`` is not None and not an integer >= 1.
    """
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window: {sliding_window!r} must be None or an integer >= 1")
    return sliding_window
