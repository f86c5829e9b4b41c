"""One rank's worker: it owns the model, the attention backend, the KV tensors, the compiled or graph forward and
the model runner (batch, sampler). The executor talks to it in three calls: size the KV cache, initialize it (and
compile), then :meth:`Worker.execute` once per step (nano-vllm's ``ModelRunner``, vLLM v1's ``Worker``)."""
from __future__ import annotations

import torch

from ..attention import select_attention_backend
from ..attention.base import AttentionBackend, check_features
from ..config import EngineConfig
from ..outputs import ModelRunnerOutput
from ..scheduler_output import SchedulerOutput
from .compiled import DEFAULT_COMPILE_SIZES, CompiledForward, use_compiled
from .cuda_graphs import CudaGraphForward, capture_cuda_graphs
from ..kv_layout import kv_layout_of
from .kv_tensors import allocate_layer_kv_caches, kv_block_bytes, kv_cache_dtype
from .memory import kv_cache_bytes
from .model_runner import ModelRunner


class Worker:
    """One rank's model and everything it needs to run steps.

    Args:
        model: this rank's model (:class:`pagedserve.models.interface.CausalLM`).
        config: the engine configuration (block size, KV dtype, compile settings, seed).
        device: where the model runs.
        backend: the attention backend; None selects ``config.attention_backend`` for ``device`` (with bf16 prefill
            attention where the model's prefill numerics are approximate already, :mod:`pagedserve.attention.cpu`).
        rank: the tensor-parallel rank (rank 0, the driver, samples).
        dtype: the model's dtype as configured ("auto" KV caches take it); None: the model's norm weights' dtype.
    """

    def __init__(self, model, config: EngineConfig, device: torch.device, backend: AttentionBackend | None = None,
                 rank: int = 0, dtype: torch.dtype | None = None):
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.rank = rank
        if backend is None:
            backend = select_attention_backend(config.attention_backend, self.device)
        check_features(backend, getattr(model, "attention_features", dict)())
        self.backend = backend
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype or model.norm.dtype, self.device,
                                       gguf_quantized=getattr(model, "gguf_quantized", False))
        self.kv_layout = kv_layout_of(model)   # KV layer groups: one block table per group (hybrid models)
        self.block_bytes = kv_block_bytes(self.kv_layout.layers_per_group, config.block_size, model.num_kv_heads,
                                          model.head_dim, self.kv_dtype)
        self.runner: ModelRunner | None = None

    @property
    def kv_caches(self):
        """Per layer ``(k_cache, v_cache)`` ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self.runner.kv_caches

    @property
    def compiled(self):
        """The CompiledForward / CudaGraphForward the steps run (None: eager)."""
        return self.runner.compiled

    def local_num_kv_blocks(self) -> int:
        """KV blocks this rank's memory gives the cache: ``config.num_kv_blocks``, or
        :func:`pagedserve.worker.memory.kv_cache_bytes` in blocks of :attr:`block_bytes`.

        Raises:
            ValueError: on CUDA, when nothing is left for the KV cache.
        """
        config = self.config
        return config.num_kv_blocks or max(1, kv_cache_bytes(config, self.model, self.backend, self.device)
                                           // self.block_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks (zeroed) and the model runner over them."""
        model, config = self.model, self.config
        kv_caches = allocate_layer_kv_caches(self.kv_layout, num_blocks, config.block_size, model.num_kv_heads,
                                             model.head_dim, self.kv_dtype, self.device)
        self.runner = ModelRunner(model, self.backend, kv_caches, config.block_size, self.device, config.seed,
                                  is_driver=self.rank == 0, kv_layout=self.kv_layout)

    def compile_or_warm_up(self, max_model_len: int, compile_sizes=None) -> None:
        """Compile the forward (CPU: inductor; CUDA: decode CUDA graphs) unless it runs eager
        (:func:`pagedserve.worker.compiled.use_compiled`)."""
        config, runner = self.config, self.runner
        if not use_compiled(config.enforce_eager, self.backend, self.device, config.tensor_parallel_size,
                            self.model):
            return
        if self.device.type == "cuda":
            runner.compiled = capture_cuda_graphs(config, self.model, self.backend, runner.kv_caches, max_model_len,
                                                  compile_sizes)
        else:
            runner.compiled = CompiledForward(self.model, self.backend, runner.kv_caches,
                                              compile_sizes or DEFAULT_COMPILE_SIZES)
            runner.compiled.warm_up()

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step (:meth:`ModelRunner.execute`); None on ranks other than the driver."""
        return self.runner.execute(sched)

    def describe(self) -> dict:
        """What the engine's info reports of this worker."""
        compiled = self.runner.compiled if self.runner is not None else None
        dtype = getattr(self.backend, "prefill_dtype", None)
        return dict(attention_backend=self.backend.name, attention_kernel=self.backend.kernel_name(),
                    kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
                    kv_block_bytes=self.block_bytes, device=str(self.device),
                    prefill_attention_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
                    compiled=compiled is not None,
                    compile_s=compiled.compile_s if compiled is not None else None,
                    compile_cache=compiled.compile_cache if compiled is not None else None,
                    cuda_graphs=isinstance(compiled, CudaGraphForward))
