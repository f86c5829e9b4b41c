"""What runs on the device, fed only plain step data (:mod:`pagedserve.scheduler_output`): the worker
(:mod:`.worker`: model, attention backend, KV tensors, compiled forward), its model runner and the requests' own
state with the sampling tensors (:mod:`.model_runner`, :mod:`.input_batch`), device/dtype resolution, the compiled
and CUDA-graph forwards, and the tensor-parallel worker loop (ranks 1..N-1). Nothing here imports request.py,
engine/ or core/."""
