"""Executors: how a model step runs. Size 1: in this process (the engine calls the model directly). Size > 1:
tensor parallelism over torch.distributed (:mod:`.driver` on rank 0, the server process; :mod:`.worker` on ranks
1..N-1, spawned here or launched by torchrun, see :mod:`.torchrun`)."""
