"""KV block accounting: the block pool with its prefix cache (:mod:`.block_pool`) and the per-request manager
(:mod:`.manager`). Block ids only; the tensors the ids index are allocated in :mod:`pagedserve.worker.kv_tensors`."""
