"""The single-process executor: the model runs in this process (tensor-parallel size 1)."""
from __future__ import annotations

import torch

from ..attention.base import AttentionBackend, AttentionMetadata
from .base import Executor


class UniProcExecutor(Executor):
    """Calls the model directly. Args: ``model`` (:class:`pagedserve.models.interface.CausalLM`)."""

    def __init__(self, model):
        super().__init__(model, 1)

    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                      meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def agree_num_kv_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        self.runner.backend.copy_blocks(self.runner.kv_caches, block_copies)

    def close(self) -> None:
        """Nothing to release."""
