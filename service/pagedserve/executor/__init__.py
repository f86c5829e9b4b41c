"""Executors: how a model step runs (:class:`.base.Executor`). Size 1: :class:`.uniproc.UniProcExecutor`, in this
process. Size > 1: :class:`.tensor_parallel.TensorParallelExecutor`, rank 0 (the server process) fronting workers
1..N-1 over torch.distributed (their loop is :mod:`pagedserve.worker.tp_worker`), spawned here or launched by
torchrun (:mod:`pagedserve.torchrun`)."""
