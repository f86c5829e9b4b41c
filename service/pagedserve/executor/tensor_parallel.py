"""Rank 0 of tensor parallelism: the server process's shard of the model, fronting the workers.

:class:`TensorParallelExecutor` implements the executor interface (:mod:`.base`): each step is one broadcast of
the plain :class:`~pagedserve.scheduler_output.SchedulerOutput` (pickled on the gloo control group), after which
every rank's worker runs the same step on its shard, joining the collectives; only rank 0's worker samples. The
scheduler and KV block accounting stay on rank 0; the block tables index every rank's cache, since all ranks
allocate the same number of blocks.

Faults: a dead worker process is seen before the next step (``is_alive``) or by a failing collective, a hung one
by the collective timeout (``collective_timeout_s``); the call then raises :class:`TensorParallelError`, the
remaining workers are killed, and the engine loop dies, which ends open calls with UNAVAILABLE and turns health
NOT_SERVING. :meth:`close` (server shutdown, or process exit) stops the workers; they also exit when the server
process is gone (:func:`.group.die_with_parent`). One tensor-parallel engine per process at a time (it owns the
default process group, released on close or failure).
"""
from __future__ import annotations

import atexit
import multiprocessing
import socket
import time

import structlog
import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..models.layers import TPGroup, split_heads
from ..outputs import ModelRunnerOutput
from ..scheduler_output import SchedulerOutput
from ..worker import tp_group as group
from ..worker.device import resolve_dtype
from ..worker.worker import Worker
from .base import Executor
from ..worker.tp_worker import WorkerSpec, agree_num_blocks, build_shard, check_quantization, meta_to, rank_device, \
    worker_main

log = structlog.get_logger(__name__)
STOP_WAIT_S = 10.0   # how long close() waits for a worker to exit before killing it


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung past the collective timeout, or failed a step."""


class TensorParallelExecutor(Executor):
    """Rank 0's worker plus the worker processes: each step's scheduler output is broadcast before rank 0 runs it,
    so every rank makes the same calls.

    Args:
        worker: rank 0's worker. dtype: the model's dtype. control: the gloo control group. processes: the spawned
        workers ([] under torchrun). size: tensor_parallel_size.
    """

    def __init__(self, worker: Worker, dtype: torch.dtype, control, processes: list, size: int):
        super().__init__(worker, dtype, size)
        self.control, self.processes, self.size = control, processes, size
        self.failed: BaseException | None = None
        self.closed = False
        atexit.register(self.close)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One broadcast of ``sched``, then rank 0's step (the workers run theirs)."""
        self._send(("step", sched))
        return self._guard(self.worker.execute, sched)

    def execute_model(self, input_ids, positions, kv_caches, meta, backend):
        """One bare forward on every rank (outside the step path: tests, profiling); rank 0's hidden states."""
        cpu = torch.device("cpu")
        self._send(("forward", input_ids.cpu(), positions.cpu(), meta_to(meta, cpu)))
        return self._guard(self.model, input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0's gathered float32 ``[N, vocab]`` logits (every worker runs its LM head shard on ``hidden``;
        outside the step path, as :meth:`execute_model`)."""
        self._send(("logits", hidden.cpu()))
        return self._guard(self.model.compute_logits, hidden)

    def agree_num_kv_blocks(self, num_blocks: int) -> int:
        """KV blocks every rank allocates: the minimum of ``num_blocks`` (rank 0's) and each worker's limit."""
        self._send(("kv", num_blocks))
        return self._guard(agree_num_blocks, num_blocks, self.control)

    def _send(self, message) -> None:
        if self.failed is not None or self.closed:
            raise TensorParallelError(f"tensor parallelism is down: {self.failed!r}")
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            self._fail(TensorParallelError(f"tensor-parallel worker(s) {dead} exited"))
        self._guard(group.send, self.control, message)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:   # gloo/NCCL errors, timeouts (DistBackendError is a RuntimeError)
            self._fail(exc)

    def _fail(self, exc: BaseException):
        self.failed = exc
        log.error("tensor_parallel_failed", error=repr(exc))
        self._kill()
        _destroy_group()   # this process may start another tensor-parallel engine (one group per process)
        if isinstance(exc, TensorParallelError):
            raise exc
        raise TensorParallelError(f"a tensor-parallel collective failed: {exc}") from exc

    def _kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(STOP_WAIT_S)

    def close(self) -> None:
        """Stop every worker (asks them, then kills those still running after STOP_WAIT_S). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.failed is None:
            try:
                group.send(self.control, ("stop",))
            except Exception as exc:
                log.warning("tensor_parallel_stop_failed", error=repr(exc))
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        atexit.unregister(self.close)
        if self.failed is None:
            _destroy_group()


def _destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:
            log.warning("tensor_parallel_destroy_failed", error=repr(exc))


def check_splittable(config: EngineConfig, hf_config) -> None:
    """Refuse before any worker starts: head counts the size does not split, or quantized weights whose groups it
    does not split (:func:`~.worker.check_quantization`). Raises ValueError naming the head counts (or the sizes)."""
    from ..models.loader import ModelSource
    check_quantization(config, ModelSource.resolve(config.model), rank_device(config, 0), hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    split_heads(heads, kv_heads, TPGroup(0, config.tensor_parallel_size))
    if hf_config.intermediate_size % config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} does not divide the model's "
                         f"intermediate_size {hf_config.intermediate_size}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(config: EngineConfig, hf_config, init_method: str | None = None,
                          rank: int = 0) -> TensorParallelExecutor:
    """Spawn workers 1..N-1 (none when ``init_method`` is given: torchrun started them), join the group as rank
    ``rank`` (0) and load rank 0's shard.

    Raises:
        ValueError: the model does not split by ``config.tensor_parallel_size`` (see :func:`check_splittable`).
        TensorParallelError: the ranks did not all join and load within ``group.STARTUP_TIMEOUT_S``.
    """
    check_splittable(config, hf_config)
    size = config.tensor_parallel_size
    processes = []
    if init_method is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        for r in range(1, size):
            p = ctx.Process(target=worker_main, args=(WorkerSpec(config, r, size, init_method, r),),
                            name=f"pagedserve-tp-rank{r}", daemon=True)
            p.start()
            processes.append(p)
    try:
        device = rank_device(config, 0)
        tp, control = group.init_groups(rank, size, device, init_method, config.collective_timeout_s)
        model = build_shard(config, tp, device)
        group.wait_for_all_ranks()
    except BaseException as exc:
        for p in processes:
            p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise TensorParallelError(f"tensor-parallel start-up failed: {exc}") from exc
    log.info("tensor_parallel_ready", size=size, backend=dist.get_backend(), worker_pids=[p.pid for p in processes])
    dtype = resolve_dtype(config.dtype, device)
    return TensorParallelExecutor(Worker(model, config, device, dtype=dtype), dtype, control, processes, size)
