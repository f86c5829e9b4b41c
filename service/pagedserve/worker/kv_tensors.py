"""The KV cache's tensors: their element type, size per block and allocation (the block accounting that indexes
them is :mod:`pagedserve.core.kv_cache`)."""
from __future__ import annotations

import torch


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``, zeroed."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def allocate_layer_kv_caches(layout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)`` under a :class:`~pagedserve.kv_layout.KVLayout`: ``layers_per_group``
    tensor pairs (:func:`allocate_kv_caches`), layer ``l`` given pair ``layout.layer_slot[l]`` (one pair per layer
    with one group)."""
    caches = allocate_kv_caches(layout.layers_per_group, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                device)
    return [caches[slot] for slot in layout.layer_slot]


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                   gguf_quantized: bool = False) -> torch.dtype:
    """The KV cache's element type for ``EngineConfig.kv_cache_dtype`` ``name``: "auto" is ``model_dtype``, but
    float16 for a float32 model on CPU that runs a GGUF file's quantized weights as stored (``gguf_quantized``:
    llama.cpp's default cache type, half the bytes a decode step's attention reads; a GGUF model dequantized with
    ``quantization="none"`` keeps ``model_dtype``); otherwise ``torch.<name>``.

    Raises:
        ValueError: naming kv_cache_dtype, a type other than ``model_dtype`` on a non-CPU device (the CUDA kernels
            read and write the cache in the model's dtype only).
    """
    if name == "auto":
        cpu_f32 = device.type == "cpu" and model_dtype == torch.float32
        return torch.float16 if gguf_quantized and cpu_f32 else model_dtype
    dtype = getattr(torch, name)
    if dtype != model_dtype and device.type != "cpu":
        raise ValueError(f"kv_cache_dtype: {name} differs from the model dtype {str(model_dtype).removeprefix('torch.')}; a cache "
                         f"type of its own is supported on CPU only (use auto on {device.type})")
    return dtype


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over ``num_layers`` layers (a layout's ``layers_per_group``: the tensors a block id
    indexes), K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
