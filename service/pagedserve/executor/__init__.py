"""Executors: how a step runs (:class:`.base.Executor`: ``execute(SchedulerOutput) -> ModelRunnerOutput``, one call).
Size 1: :class:`.uniproc.UniProcExecutor`, the worker in this process. Size > 1:
:class:`.tensor_parallel.TensorParallelExecutor`, rank 0 (the server process) broadcasting each step to workers
1..N-1 over torch.distributed (their loop is :mod:`pagedserve.worker.tp_worker`), spawned here or launched by
torchrun (:mod:`pagedserve.torchrun`). :func:`.factory.build_executor` builds the one a config asks for."""
