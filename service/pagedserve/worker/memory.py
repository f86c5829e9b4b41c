"""How much memory the KV cache gets on this process: the configured size, or on CUDA what is left after the
weights and a profiled forward (vLLM's profiling run)."""
from __future__ import annotations

import torch

from ..attention.base import AttentionMetadata
from ..config import EngineConfig
from .kv_tensors import allocate_kv_caches, kv_cache_dtype

# 2 GiB (93,200 tokens of the embedded model's float16 K/V, 46,592 in float32; vLLM CPU's VLLM_CPU_KVCACHE_SPACE in
# the comparison).
# Against 1 GiB it served 32 streams of 1,024-token prompts at 60.2 vs 56.0 out tok/s, TTFT p50 2.7 vs 12.3 s
# (bench/README.md). Zeroed up front (allocate_kv_caches): a calloc'd cache committed on first write was tried, but
# first-touch faults cost ~0.9 ms per MB on the 2-core VM (400 MB: 357 ms first, 23 ms again), ~40 ms on the TTFT of
# each 1,024-token prompt until the free-block queue has cycled. The test suite's in-process engines run at 1 GiB
# (tests/conftest.py: one process holds many engines).
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def kv_cache_bytes(config: EngineConfig, model, backend, device: torch.device) -> int:
    """Bytes to give the KV cache: ``--kv-cache-memory-bytes`` when set; on CPU 2 GiB; on CUDA, what
    ``gpu_memory_utilization`` of the device's memory leaves after the weights and the peak of a profiled forward
    pass over ``max_num_batched_tokens`` tokens (vLLM's profiling run).

    Raises:
        ValueError: on CUDA, when nothing is left for the KV cache.
    """
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    peak = profile_peak_memory_bytes(config, model, backend, device)
    total = torch.cuda.get_device_properties(device).total_memory
    free_for_kv = int(total * config.gpu_memory_utilization) - peak
    if free_for_kv <= 0:
        raise ValueError(f"gpu_memory_utilization {config.gpu_memory_utilization}: the weights and activations "
                         f"already take {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB")
    return free_for_kv


@torch.inference_mode()
def profile_peak_memory_bytes(config: EngineConfig, model, backend, device: torch.device) -> int:
    """Peak CUDA memory of one prefill forward over ``max_num_batched_tokens`` tokens (weights included), run
    against a one-block dummy KV cache with every slot marked as padding."""
    n = min(config.max_num_batched_tokens, int(model.config.max_position_embeddings))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    caches = allocate_kv_caches(model.num_layers, 1, config.block_size, model.num_kv_heads, model.head_dim,
                                kv_cache_dtype(config.kv_cache_dtype, model.norm.dtype, device), device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((1, -(-n // config.block_size)), **i32),
        context_lens=torch.tensor([n], **i32), query_start_loc=torch.tensor([0, n], **i32),
        query_lens=torch.tensor([n], **i32), max_query_len=n, max_context_len=n, num_decode_seqs=0,
        query_lens_cpu=[n], context_lens_cpu=[n])
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(n, device=device), caches, meta, backend)
    model.compute_logits(hidden[-min(n, config.max_num_seqs):])
    torch.cuda.synchronize(device)
    del caches, hidden
    return int(torch.cuda.max_memory_allocated(device))
