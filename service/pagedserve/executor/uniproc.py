"""The single-process executor: the worker runs in this process (tensor-parallel size 1)."""
from __future__ import annotations

from ..outputs import ModelRunnerOutput
from ..scheduler_output import SchedulerOutput
from .base import Executor


class UniProcExecutor(Executor):
    """Calls its worker directly. Args: as :class:`~.base.Executor` (size 1)."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(sched)

    def agree_num_kv_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def close(self) -> None:
        """Nothing to release."""
