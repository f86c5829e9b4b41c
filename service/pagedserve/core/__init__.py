"""The engine core's bookkeeping: the scheduler (:mod:`.sched`), the KV block accounting (:mod:`.kv_cache`) and the
incremental detokenizer (:mod:`.detokenizer`, for stop strings). No tensors here: what runs on the device lives in
:mod:`pagedserve.worker`."""
