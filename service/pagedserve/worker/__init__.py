"""What runs on the device: the model runner and its batch, the KV tensors, device/dtype resolution, the compiled
and CUDA-graph forwards, and the tensor-parallel worker loop (ranks 1..N-1)."""
