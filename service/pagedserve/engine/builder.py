"""Builds a ready :class:`LLMEngine` from an :class:`EngineConfig`: device, dtype, model, tokenizer, KV cache."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import structlog

from ..config import EngineConfig
from ..models.loader import ModelSource
from ..models.registry import architecture_of, build_model
from ..attention import select_attention_backend
from ..attention.cpu import use_bf16_prefill_attention
from ..executor.base import Executor
from ..executor.tensor_parallel import check_splittable, start_tensor_parallel
from ..executor.uniproc import UniProcExecutor
from ..worker.compiled import DEFAULT_COMPILE_SIZES, CompiledForward, use_compiled
from ..worker.cuda_graphs import CudaGraphForward
from ..worker.device import resolve_device, resolve_dtype
from ..worker.kv_tensors import allocate_kv_caches, kv_block_bytes, kv_cache_dtype
from .llm_engine import LLMEngine

log = structlog.get_logger(__name__)

@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What GetModelInfo and the startup line report."""

    name: str
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    kv_block_bytes: int
    prefix_caching: bool
    quantization: str   # the model's ``quantization`` ("none" or what models.quant_load built)
    tensor_parallel_size: int = 1   # ranks the model is split over
    compiled: bool = False               # the forward runs compiled (engine.compiled); False: eager
    compile_s: float | None = None       # seconds compiling took at start-up (None when eager)
    compile_cache: str | None = None     # "warm" (inductor's on-disk cache held every graph) or "cold"; None: eager
    cuda_graphs: bool = False            # "compiled" on CUDA: decode steps replay CUDA graphs (engine.cuda_graphs)
    linear_kernels: str = "torch"        # whose kernels run the linears: "pagedserve-cpu" (models.cpu_linear) or "torch"
    speculative: str | None = None       # the speculative decoding method ("ngram, 4 drafts"); None: off
    kv_cache_dtype: str = "float32"      # the KV cache's element type (--kv-cache-dtype; auto: the model's dtype)
    prefill_attention_dtype: str | None = None   # "bfloat16": prefill SDPA in bf16 (attention.cpu); None: model's


def _prefill_dtype_name(backend) -> str | None:
    dtype = getattr(backend, "prefill_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def eos_token_ids(source: ModelSource, tokenizer) -> frozenset[int]:
    """EOS ids: the tokenizer's, plus ``generation_config.json``'s ``eos_token_id`` (an int or a list)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = os.path.join(source.directory, "generation_config.json")
    if source.gguf_file is None and os.path.exists(gen_cfg):
        eos = json.load(open(gen_cfg)).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


def build_engine(config: EngineConfig, *, model=None, tokenizer=None, hf_config=None,
                 backend=None, compile_sizes=None, tp_init_method: str | None = None) -> tuple[LLMEngine, EngineInfo]:
    """Load the model and tokenizer, size the KV cache, and compile the forward unless it runs eager
    (``config.enforce_eager``; :func:`pagedserve.worker.compiled.use_compiled`).

    ``model``/``tokenizer``/``hf_config`` may be passed in (tests build random-weight models); otherwise they are
    loaded from ``config.model``. ``backend`` (an attention backend object) overrides the one
    ``config.attention_backend`` selects (tests run the emulated CUDA backend on CPU). ``compile_sizes`` overrides
    the padded token counts compiled (default :data:`~pagedserve.worker.compiled.DEFAULT_COMPILE_SIZES`).
    ``tp_init_method``: the tensor-parallel group's init method when the other ranks exist already (torchrun's
    ``env://``); None spawns them.

    Raises:
        FileNotFoundError: the model path is missing.
        ValueError: unsupported architecture, or ``max_model_len`` larger than the model or the KV cache allows.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    source = ModelSource.resolve(config.model) if model is None or tokenizer is None else None
    hf_config = hf_config or (model.config if model is not None else source.load_config())
    tensor_parallel = model is None and config.tensor_parallel_size > 1
    if tensor_parallel:
        check_splittable(config, hf_config)   # before anything slow: a size that cannot split fails at once
    tokenizer = tokenizer or source.load_tokenizer()
    if tensor_parallel:
        executor = start_tensor_parallel(config, hf_config, tp_init_method)
    else:
        executor = UniProcExecutor(model or build_model(source, hf_config, dtype, device, config.quantization,
                                                        config.quant_group_size, linear_kernels=config.linear_kernels))
    try:
        return _finish_engine(config, executor, tokenizer, hf_config, source, device, dtype, backend, compile_sizes)
    except BaseException:
        executor.close()
        raise


def _max_model_len(config: EngineConfig, hf_config, num_blocks: int) -> int:
    capacity = num_blocks * config.block_size
    model_max = int(hf_config.max_position_embeddings)
    if config.max_model_len is None:
        return min(model_max, capacity)
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len {config.max_model_len} > the model's {model_max}")
    if config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} > KV cache capacity {capacity} tokens "
                         f"({num_blocks} blocks of {config.block_size}); give more --kv-cache-memory")
    return config.max_model_len


def _finish_engine(config: EngineConfig, executor: Executor, tokenizer, hf_config, source, device, dtype, backend,
                   compile_sizes) -> tuple[LLMEngine, EngineInfo]:
    model = executor.model
    if backend is None:
        backend = select_attention_backend(config.attention_backend, device)
        use_bf16_prefill_attention(backend, model)   # where the prefill's numerics are approximate already
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    block_bytes = kv_block_bytes(model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, kv_dtype)
    num_blocks = executor.determine_num_kv_blocks(config, backend, device, block_bytes)
    max_model_len = _max_model_len(config, hf_config, num_blocks)
    kv_caches = allocate_kv_caches(model.num_layers, num_blocks, config.block_size, model.num_kv_heads,
                                   model.head_dim, kv_dtype, device)
    runner = executor.init_runner(backend, kv_caches, config.block_size, device, config.seed)
    if use_compiled(config.enforce_eager, backend, device, config.tensor_parallel_size):
        if device.type == "cuda":
            runner.compiled = capture_cuda_graphs(config, model, backend, kv_caches, max_model_len, compile_sizes)
        else:
            runner.compiled = CompiledForward(model, backend, kv_caches, compile_sizes or DEFAULT_COMPILE_SIZES)
            runner.compiled.warm_up()
    engine = LLMEngine(config, executor, tokenizer, num_blocks, max_model_len,
                       eos_token_ids(source, tokenizer) if source else frozenset([tokenizer.eos_token_id]),
                       int(hf_config.vocab_size))
    compiled = runner.compiled
    info = EngineInfo(name=config.model or (source.name if source else "custom"),
                      architecture=architecture_of(hf_config), dtype=str(dtype).removeprefix("torch."),
                      device=str(device), attention_backend=backend.name, max_model_len=max_model_len,
                      vocab_size=int(hf_config.vocab_size), block_size=config.block_size, num_kv_blocks=num_blocks,
                      kv_block_bytes=block_bytes, prefix_caching=config.enable_prefix_caching,
                      kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
                      prefill_attention_dtype=_prefill_dtype_name(backend),
                      quantization=model.quantization,
                      tensor_parallel_size=executor.tensor_parallel_size,
                      compiled=compiled is not None,
                      compile_s=compiled.compile_s if compiled is not None else None,
                      compile_cache=compiled.compile_cache if compiled is not None else None,
                      cuda_graphs=isinstance(compiled, CudaGraphForward),
                      linear_kernels=model.linear_kernels,
                      speculative=_speculative_summary(config))
    return engine, info


def _speculative_summary(config: EngineConfig) -> str | None:
    spec = config.speculative()
    return None if spec is None else f"{spec.method}, {spec.num_speculative_tokens} drafts"


def capture_cuda_graphs(config: EngineConfig, model, backend, kv_caches, max_model_len: int,
                        sizes=None) -> CudaGraphForward | None:
    """CUDA graphs of decode steps for the padded batch sizes up to the first one >= ``max_num_seqs`` (no larger
    decode batch can be scheduled). A failed capture fails start-up under ``enforce_eager=False``; with the
    default (None) it is logged and the engine runs eager (returns None)."""
    sizes = sorted(set(sizes or DEFAULT_COMPILE_SIZES))
    sizes = [s for s in sizes if s < config.max_num_seqs] + [s for s in sizes if s >= config.max_num_seqs][:1]
    graphs = CudaGraphForward(model, backend, kv_caches, max_model_len, config.block_size, sizes)
    try:
        graphs.warm_up()
    except Exception as exc:
        if config.enforce_eager is False:
            raise
        log.warning("cuda_graphs_failed", error=str(exc), fallback="eager")
        return None
    return graphs
