"""The executor interface: how the engine's steps run, in this process or over tensor-parallel ranks.

The engine calls :meth:`Executor.execute` once per step with the scheduler's plain
:class:`~pagedserve.scheduler_output.SchedulerOutput` and gets a plain :class:`~pagedserve.outputs.ModelRunnerOutput`
back: the executor owns the worker (:class:`pagedserve.worker.worker.Worker`), which owns the model, the KV
tensors, the compiled forward and the sampler. Under tensor parallelism that one call is one broadcast. The builder
sizes the KV cache through :meth:`Executor.determine_num_kv_blocks` (every rank allocates the same number of
blocks) and then calls :meth:`Executor.initialize`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..outputs import ModelRunnerOutput
from ..scheduler_output import SchedulerOutput
from ..worker.worker import Worker


class Executor(ABC):
    """Runs steps on its worker (rank 0's under tensor parallelism, whose model's shapes, config and dtype are what
    the builder reads).

    Args:
        worker: this process's worker.
        dtype: the model's dtype. tensor_parallel_size: ranks the model is split over.
    """

    def __init__(self, worker: Worker, dtype: torch.dtype, tensor_parallel_size: int = 1):
        self.worker = worker
        self.dtype = dtype
        self.tensor_parallel_size = tensor_parallel_size

    @property
    def model(self):
        """This process's model (:class:`pagedserve.models.interface.CausalLM`; rank 0's shard)."""
        return self.worker.model

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def determine_num_kv_blocks(self) -> int:
        """KV blocks every rank allocates: this process's :meth:`Worker.local_num_kv_blocks`, agreed over the
        ranks (:meth:`agree_num_kv_blocks`).

        Raises:
            ValueError: on CUDA, when nothing is left for the KV cache.
        """
        return self.agree_num_kv_blocks(self.worker.local_num_kv_blocks())

    def initialize(self, num_blocks: int, max_model_len: int, compile_sizes=None) -> None:
        """Allocate the KV cache (``num_blocks`` blocks, after :meth:`determine_num_kv_blocks`) and compile the
        forward unless it runs eager (:meth:`Worker.compile_or_warm_up`)."""
        self.worker.initialize_kv_cache(num_blocks)
        self.worker.compile_or_warm_up(max_model_len, compile_sizes)

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every rank; rank 0's output."""

    @abstractmethod
    def agree_num_kv_blocks(self, num_blocks: int) -> int:
        """KV blocks every rank allocates, given this process's ``num_blocks`` (the minimum over ranks)."""

    def describe(self) -> dict:
        """What the engine's info reports of the executor (:meth:`Worker.describe`, the dtype, the size)."""
        return dict(self.worker.describe(), dtype=str(self.dtype).removeprefix("torch."),
                    tensor_parallel_size=self.tensor_parallel_size)

    @abstractmethod
    def close(self) -> None:
        """Release what the executor holds (worker processes). Idempotent."""
