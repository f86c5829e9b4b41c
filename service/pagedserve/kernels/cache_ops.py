"""Launchers of cuda/cache_ops.cu: writing a step's new K/V rows into the paged cache, and copy-on-write block
copies. Arguments are checked (:mod:`pagedserve.kernels.checks`) before the current runtime sees them."""
from __future__ import annotations

import numpy as np
import torch

from . import geometry as geo
from .checks import check_cache_shape, check_tensor
from .runtime import current_runtime, module_key


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` rows into the paged caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` at ``slot_mapping`` (``[T]`` int64; ``< 0`` skipped).
    Same semantics as :func:`pagedserve.attention.torch_ref.reshape_and_cache`. Slots must be < num_blocks *
    block_size (not checked: that would need a device sync)."""
    check_tensor("key", key, ndim=3)
    geo.dtype_name(key.dtype, "key")
    if isinstance(k_cache, torch.Tensor) and key.dtype != k_cache.dtype:
        raise ValueError(f"key: dtype {key.dtype} does not match k_cache dtype {k_cache.dtype}")
    _, _, num_kv_heads, head_dim = check_cache_shape(k_cache, v_cache, key.dtype)
    check_tensor("key", key, ndim=3, shape=(None, num_kv_heads, head_dim), inner_contiguous=2)
    check_tensor("value", value, dtypes=(key.dtype,), shape=tuple(key.shape), inner_contiguous=2)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(key.shape[0],), ndim=1,
                 contiguous=True)
    rt = current_runtime()
    ptr = rt.pointer
    device = rt.check_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if key.shape[0] == 0:
        return
    es = key.element_size()
    row_bytes = num_kv_heads * head_dim * es
    unit = geo.copy_unit_bytes(key.data_ptr(), value.data_ptr(), key.stride(0) * es, value.stride(0) * es,
                               row_bytes)
    g = geo.plan_rows(key.shape[0], row_bytes // unit, max_threads=256)
    args = (ptr(key), ptr(value), ptr(k_cache), ptr(v_cache), ptr(slot_mapping),
            np.int64(key.stride(0) * es // unit), np.int64(value.stride(0) * es // unit), np.int32(row_bytes // unit))
    rt.launch(module_key(rt, device, "cache"), geo.reshape_and_cache_kernel_name(unit), device, g.grid, g.block,
              args)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For each ``(src, dst)`` row of ``block_mapping`` (``[num_pairs, 2]`` int64), copy block ``src`` to block
    ``dst`` in every layer's K and V cache (copy-on-write). All caches share one shape and dtype."""
    if not k_caches or len(k_caches) != len(v_caches):
        raise ValueError("k_caches: need one or more layers and as many v_caches")
    check_tensor("k_caches[0]", k_caches[0])
    first = k_caches[0]
    geo.dtype_name(first.dtype, "k_caches")
    for i, (k, v) in enumerate(zip(k_caches, v_caches)):
        check_tensor(f"k_caches[{i}]", k, dtypes=(first.dtype,), shape=tuple(first.shape), ndim=first.dim(),
                     contiguous=True)
        check_tensor(f"v_caches[{i}]", v, dtypes=(first.dtype,), shape=tuple(first.shape), ndim=first.dim(),
                     contiguous=True)
    check_tensor("block_mapping", block_mapping, dtypes=(torch.int64,), ndim=2, shape=(None, 2), contiguous=True)
    if block_mapping.shape[0] > 65535:
        raise ValueError(f"block_mapping: at most 65535 pairs per call, got {block_mapping.shape[0]}")
    rt = current_runtime()
    ptr = rt.pointer
    device = rt.check_device(block_mapping=block_mapping, **{f"k_caches[{i}]": k for i, k in enumerate(k_caches)},
                             **{f"v_caches[{i}]": v for i, v in enumerate(v_caches)})
    if block_mapping.shape[0] == 0:
        return
    block_bytes = first[0].numel() * first.element_size()
    caches = list(k_caches) + list(v_caches)
    unit = geo.copy_unit_bytes(block_bytes, *(c.data_ptr() for c in caches))
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(device, non_blocking=True)
    num_layers = len(k_caches)
    g = geo.plan_rows(num_layers, block_bytes // unit, max_threads=512)
    args = (ptr(ptrs), np.uint64(ptrs.data_ptr() + 8 * num_layers), ptr(block_mapping),
            np.int64(block_bytes // unit))
    rt.launch(module_key(rt, device, "cache"), geo.copy_blocks_kernel_name(unit), device,
              (num_layers, block_mapping.shape[0], 1), g.block, args)
