"""The model contract: everything the engine, the model runner, the builder and the executor may use of a causal LM.

Anything else on a model class is private to it. A model that runs under tensor parallelism keeps the same
contract on every rank; the only difference is that ``compute_logits`` returns None off rank 0, and that every rank
must make the same calls in the same order (they hold collectives).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from ..attention.base import AttentionBackend, AttentionMetadata


@runtime_checkable
class CausalLM(Protocol):
    """What a generation model gives the engine.

    Attributes:
        config: the transformers ``PretrainedConfig`` it was built from (``max_position_embeddings``,
            ``vocab_size``, ``architectures`` are read).
        num_layers: decoder layers; one ``(k_cache, v_cache)`` pair per layer.
        num_kv_heads: KV heads THIS rank's cache holds (all of them at tensor-parallel size 1).
        head_dim: features per head.
        vocab_size: rows of the logits.
        quantization: what GetModelInfo reports ("none" or a summary of the quantized layers).
        linear_kernels: whose kernels run the linears ("torch" or "pagedserve-cpu").
        norm: a parameter whose dtype/device are the model's compute dtype/device.
    """

    config: object
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    quantization: str
    linear_kernels: str
    norm: torch.Tensor

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 backend: AttentionBackend) -> torch.Tensor:
        """One step. input_ids, positions: ``[T]`` int64; kv_caches: per layer ``(k, v)`` each
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` (written at ``meta.slot_mapping``). Returns the final
        hidden states ``[T, hidden]`` (after the last norm), replicated on every rank. No host synchronization."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden]`` -> float32 ``[N, vocab_size]`` (rank 0; None on other tensor-parallel ranks)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, object]], plan=None) -> None:
        """Copy HF-named checkpoint tensors in, each rank keeping its shard. Raises ValueError on a bad name/shape."""
        ...
