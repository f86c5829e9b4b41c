"""The executor interface: how the engine's model steps run, in this process or over tensor-parallel ranks.

The engine calls :meth:`Executor.execute` once per step; the executor's model runner (rank 0's, on its shard under
tensor parallelism) builds the batch, runs the forward and samples, through the executor's :meth:`execute_model`
and :meth:`compute_logits`, which every rank joins. The builder sizes the KV cache through
:meth:`determine_num_kv_blocks` (every rank must allocate the same number of blocks).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..attention.base import AttentionBackend, AttentionMetadata
from ..config import EngineConfig
from ..core.sched.output import SchedulerOutput
from ..outputs import StepResult
from ..worker.memory import kv_cache_bytes
from ..worker.model_runner import ModelRunner


class Executor(ABC):
    """Runs model steps. ``model`` is this process's model (rank 0's shard under tensor parallelism): its shapes,
    config and dtype are what the builder reads.

    Args:
        model: the local model (:class:`pagedserve.models.interface.CausalLM`).
        tensor_parallel_size: ranks the model is split over.
    """

    def __init__(self, model, tensor_parallel_size: int = 1):
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
        self.runner: ModelRunner | None = None

    def init_runner(self, backend: AttentionBackend, kv_caches, block_size: int, device: torch.device,
                    seed: int | None) -> ModelRunner:
        """Create the model runner over this process's KV cache tensors (after :meth:`determine_num_kv_blocks`)."""
        self.runner = ModelRunner(self.execute_model, self.compute_logits, backend, kv_caches, block_size, device,
                                  seed)
        return self.runner

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run one scheduled step: copy-on-write block copies on every rank first, then the runner's step."""
        if sched.block_copies:
            self.copy_blocks(sched.block_copies)
        return self.runner.execute(sched)

    @abstractmethod
    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                      meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """One forward on every rank (the model contract's ``__call__``); returns rank 0's hidden states."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on ``hidden`` ``[N, hidden]`` (every rank joins); float32 ``[N, vocab]``."""

    def determine_num_kv_blocks(self, config: EngineConfig, backend: AttentionBackend, device: torch.device,
                                block_bytes: int) -> int:
        """KV blocks every rank allocates: ``config.num_kv_blocks``, or what this process's memory gives the cache
        (:func:`pagedserve.worker.memory.kv_cache_bytes`) in blocks of ``block_bytes``, agreed over the ranks
        (:meth:`agree_num_kv_blocks`).

        Raises:
            ValueError: on CUDA, when nothing is left for the KV cache.
        """
        local = config.num_kv_blocks or max(1, kv_cache_bytes(config, self.model, backend, device) // block_bytes)
        return self.agree_num_kv_blocks(local)

    @abstractmethod
    def agree_num_kv_blocks(self, num_blocks: int) -> int:
        """KV blocks every rank allocates, given this process's ``num_blocks`` (the minimum over ranks)."""

    @abstractmethod
    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``(src, dst)`` in every layer on every rank (copy-on-write of shared blocks)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the executor holds (worker processes). Idempotent."""
