"""Builds a ready :class:`LLMEngine` from an :class:`EngineConfig`: device, dtype, model, tokenizer, KV cache."""
from __future__ import annotations


import json
import os
from dataclasses import dataclass

import structlog

from ..config import EngineConfig
from ..models.loader import ModelSource
from ..models.registry import architecture_of
from ..executor.base import Executor
from ..executor.factory import build_executor
from ..executor.tensor_parallel import check_splittable
from ..kv_layout import KVLayout, kv_layout_of, single_group
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
    prefill_attention_dtype: str | None = None   # a backend's prefill SDPA dtype when it differs; None: the model's
    attention_kernel: str = ""           # what the attention backend runs (AttentionBackend.kernel_name)
    batch_invariant: bool = False        # a request's tokens do not depend on its batch-mates (README, "Deterministic outputs")
    kernels: str = ""                    # which linear and attention kernels run ("linears: ...; attention: ...")
    num_layers: int = 0                  # decoder layers
    num_kv_heads: int = 0                # KV heads of the whole model (all tensor-parallel ranks)
    head_dim: int = 0
    sliding_windows: tuple[int, ...] = ()   # per layer its window in tokens, 0: full attention; (): no window
    num_experts: int = 0                 # experts per mixture-of-experts layer (0: dense)
    num_experts_per_token: int = 0       # top-k routing (0: dense)


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
    """Load the model (in its executor) and the tokenizer, size the KV cache, and compile the forward unless it
    runs eager (``config.enforce_eager``; :func:`pagedserve.worker.compiled.use_compiled`).

    ``model``/``tokenizer``/``hf_config`` may be passed in (tests build random-weight models); otherwise they are
    loaded from ``config.model``. ``backend`` (an attention backend object) overrides the one
    ``config.attention_backend`` selects (tests run the emulated CUDA backend on CPU). ``compile_sizes`` overrides
    the padded token counts compiled (default ``pagedserve.worker.compiled.DEFAULT_COMPILE_SIZES``).
    ``tp_init_method``: the tensor-parallel group's init method when the other ranks exist already (torchrun's
    ``env://``); None spawns them.

    Raises:
        FileNotFoundError: the model path is missing.
        ValueError: unsupported architecture, or ``max_model_len`` larger than the model or the KV cache allows.
    """
    source = ModelSource.resolve(config.model) if model is None or tokenizer is None else None
    hf_config = hf_config or (model.config if model is not None else source.load_config())
    if model is None and config.tensor_parallel_size > 1:
        check_splittable(config, hf_config)   # before anything slow: a size that cannot split fails at once
    tokenizer = tokenizer or source.load_tokenizer()
    executor = build_executor(config, source, hf_config, model, backend, tp_init_method)
    try:
        return _finish_engine(config, executor, tokenizer, hf_config, source, compile_sizes)
    except BaseException:
        executor.close()
        raise


def _max_model_len(config: EngineConfig, hf_config, num_blocks: int, model=None) -> int:
    """The context the engine serves: ``--max-model-len``, or by default the most of the model's
    ``max_position_embeddings``, the KV cache's capacity (:func:`kv_capacity_tokens`) and the length up to which
    the model is exact (``model.max_exact_len``: a length-dependent rope type, see
    :class:`pagedserve.models.decoder.DecoderSpec`). Raises ValueError for a ``--max-model-len`` past any of them
    (past the exact length naming the config field behind it)."""
    model_max = int(hf_config.max_position_embeddings)
    capacity = kv_capacity_tokens(config, num_blocks, _kv_layout(model), model_max)
    exact = getattr(model, "max_exact_len", None)
    if config.max_model_len is None:
        if exact is not None and exact < min(model_max, capacity):
            log.warning("max_model_len capped", max_model_len=exact, reason=model.max_exact_len_reason)
            return exact
        return min(model_max, capacity)
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len {config.max_model_len} > the model's {model_max}")
    if exact is not None and config.max_model_len > exact:
        raise ValueError(f"max_model_len {config.max_model_len} > {exact}, the most this model runs exactly: "
                         f"{model.max_exact_len_reason}")
    if config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} > KV cache capacity {capacity} tokens "
                         f"({num_blocks} blocks of {config.block_size}); give more --kv-cache-memory")
    return config.max_model_len


def kv_capacity_tokens(config: EngineConfig, num_blocks: int, layout: KVLayout, model_max: int) -> int:
    """The longest context one request can hold in ``num_blocks`` blocks: a window group holds at most
    ``ceil((window + max_num_batched_tokens) / block_size) + 1`` of them however long the request, a full group one
    per ``block_size`` tokens. With no full group the context is unbounded by the cache (``model_max``) once the
    window groups fit; with none fitting, 0."""
    bs = config.block_size
    window_blocks = sum(-(-(w + config.max_num_batched_tokens) // bs) + 1 for w in layout.group_windows
                        if w is not None)
    num_full = sum(1 for w in layout.group_windows if w is None)
    if num_full == 0:
        return model_max if num_blocks >= window_blocks + 1 else num_blocks * bs
    if not window_blocks:
        return num_blocks * bs
    return max(0, num_blocks - window_blocks) // num_full * bs


def _finish_engine(config: EngineConfig, executor: Executor, tokenizer, hf_config, source,
                   compile_sizes) -> tuple[LLMEngine, EngineInfo]:
    num_blocks = executor.determine_num_kv_blocks()
    max_model_len = _max_model_len(config, hf_config, num_blocks, executor.model)
    executor.initialize(num_blocks, max_model_len, compile_sizes)
    model = executor.model
    engine = LLMEngine(config, executor, tokenizer, num_blocks, max_model_len,
                       eos_token_ids(source, tokenizer) if source else frozenset([tokenizer.eos_token_id]),
                       int(hf_config.vocab_size), kv_group_windows=_kv_layout(model).group_windows)
    described = executor.describe()
    attention = described["attention_kernel"]
    info = EngineInfo(name=config.model or (source.name if source else "custom"),
                      architecture=architecture_of(hf_config), max_model_len=max_model_len,
                      vocab_size=int(hf_config.vocab_size), block_size=config.block_size, num_kv_blocks=num_blocks,
                      prefix_caching=config.enable_prefix_caching, quantization=model.quantization,
                      linear_kernels=model.linear_kernels, speculative=_speculative_summary(config),
                      batch_invariant=bool(getattr(model, "batch_invariant", False)) and
                      attention.startswith("batch-invariant"),
                      kernels=f"linears: {getattr(model, 'linear_path', 'torch')}; attention: "
                              f"{attention or described['attention_backend']}",
                      **_model_shape(model, hf_config), **described)
    return engine, info


def _kv_layout(model) -> KVLayout:
    """The KV layer groups of ``model`` (:func:`~pagedserve.kv_layout.kv_layout_of`; one group without a model)."""
    return single_group(1) if model is None else kv_layout_of(model)


def _model_shape(model, hf_config) -> dict:
    """The :class:`EngineInfo` fields that say what the model is: KV layout, sliding windows, experts."""
    spec = getattr(model, "spec", None)
    windows = getattr(spec, "sliding_windows", None)
    moe = getattr(spec, "moe", None)
    heads = hf_config.num_attention_heads
    return dict(num_layers=int(hf_config.num_hidden_layers),
                num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
                head_dim=int(model.head_dim), sliding_windows=tuple(w or 0 for w in windows) if windows else (),
                num_experts=moe.num_experts if moe else 0, num_experts_per_token=moe.top_k if moe else 0)


def _speculative_summary(config: EngineConfig) -> str | None:
    spec = config.speculative()
    return None if spec is None else f"{spec.method}, {spec.num_speculative_tokens} drafts"
