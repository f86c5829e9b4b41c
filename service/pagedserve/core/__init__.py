"""The engine core's bookkeeping: the scheduler (:mod:`.sched`) and the KV block accounting (:mod:`.kv_cache`).
No tensors here: what runs on the device lives in :mod:`pagedserve.worker`."""
