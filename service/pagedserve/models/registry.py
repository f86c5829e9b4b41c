"""Model classes keyed by HF ``config.architectures`` names; the loader builds whatever the config names."""
from __future__ import annotations

import torch

from .gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from .gpt_oss import GptOssForCausalLM
from .granite import GraniteForCausalLM
from .llama import LlamaForCausalLM, MistralForCausalLM
from .loader import ModelSource
from .mixtral import MixtralForCausalLM
from .olmo2 import Olmo2ForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from .smollm3 import SmolLM3ForCausalLM

#: HF ``architectures`` name -> the family class (each a :class:`~.decoder.DecoderForCausalLM` with its options).
#: The README's table of supported architectures lists exactly these (tests/unit/models/test_families_table.py).
MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def architecture_of(config) -> str:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    # GGUF configs from transformers may lack `architectures`; derive it from model_type.
    return _MODEL_TYPES.get(config.model_type, config.model_type)


def build_model(source: ModelSource, config, dtype: torch.dtype, device: torch.device | str,
                quantization: str = "none", quant_group_size: int = 32, tp=None,
                linear_kernels: str = "auto") -> torch.nn.Module:
    """Instantiate the registered class for ``config`` and load its weights.

    quantization: "none" (every weight in ``dtype``), "int8", "int4" or "auto" (a GGUF file keeps its own scheme
    where a kernel exists; an HF checkpoint stays unquantized); see :mod:`.quant_load`. quant_group_size: the int4
    group size for weights quantized at load. The model's ``quantization`` attribute then says what was built.
    tp: this rank's :class:`~.layers.TPGroup` (None: the whole model); each tensor is cut to the rank's part as read.
    linear_kernels: "auto" runs the linears (quantized or float32) on pagedserve's CPU kernels where they load
    (:mod:`.cpu_linear`), the quantized ones on two-level int8 activations at every token count (one scheme per
    layer: batch-invariant); "int8-activations" one level; "float-activations" float32 activations; "torch" torch's
    kernels (not batch-invariant). The model's ``linear_kernels`` attribute says which ran, ``a8_min_tokens`` from how
    many tokens int8 activations are used (0: never), ``a8_levels`` with how many levels, ``dq_min_tokens`` from how
    many tokens the GEMM path is taken (always 0 now), ``amx_min_tokens`` from how many the int4 layers run their
    int8 activations on AMX tiles where the CPU has AMX-INT8 and they give the panels' bits (0: never);
    ``vnni_max_tokens`` up to how many tokens the int4 and int8 layers run on the AVX-512 VNNI panels (0: never);
    ``batch_invariant`` whether every linear is one numeric scheme for every token count, ``linear_path`` a line
    saying which kernels run (:func:`.cpu_linear.linear_path_of`).

    Raises:
        ValueError: for an architecture not in :data:`MODEL_REGISTRY`, a checkpoint that does not fit it, or an
            unknown ``quantization``; :class:`~.decoder.UnsupportedConfig` (a ValueError) for a config field the
            family cannot run exactly, named in the message (raised before any weight is read).
    """
    from .cpu_linear import (A8_LEVELS, A8_MIN_TOKENS, AMX_CHOICES, AMX_MIN_TOKENS, VNNI_CHOICES, VNNI_MAX_TOKENS,
                             amx_available, amx_matches_panels, cpu_kernels_enabled, linear_path_of, use_amx,
                             use_cpu_kernels, use_int8_activations, use_vnni, vnni_available)
    from .quant_load import QuantPlan, prepare_model, resolve_scheme

    arch = architecture_of(config)
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {sorted(MODEL_REGISTRY)}")
    scheme = resolve_scheme(quantization, source.gguf_file is not None, torch.device(device))
    own_kernels = cpu_kernels_enabled(linear_kernels, torch.device(device))
    plan = None if scheme == "none" else QuantPlan(scheme, quant_group_size, dtype, cpu_kernels=own_kernels)
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch](config) if tp is None or tp.size == 1 else MODEL_REGISTRY[arch](config, tp)
        if plan is not None:
            prepare_model(model, model._shards_of)
    model = model.to_empty(device="cpu").to(dtype)
    model.reset_rotary_cache()  # meta-device buffers hold no data; the table stays fp32 whatever the dtype
    from tqdm.auto import tqdm

    weights = tqdm(source.iter_weights(config, dtype, keep_quantized=plan is not None), desc="loading weights",
                   unit="tensor", disable=None)
    model.load_weights(weights, plan)
    model = model.to(device).eval()
    model.requires_grad_(False)
    model.linear_kernels, model.a8_min_tokens, model.a8_levels, model.dq_min_tokens = "torch", 0, 0, 0
    # a GGUF file's quantized weights as stored: the KV cache's auto dtype is float16 (kv_tensors.kv_cache_dtype)
    model.gguf_quantized = source.gguf_file is not None and plan is not None
    model.amx_min_tokens = model.vnni_max_tokens = 0
    model.batch_invariant, model.linear_path = False, "torch"
    if own_kernels:
        use_cpu_kernels(model)
        model.linear_kernels = "pagedserve-cpu"
        levels = A8_LEVELS.get(linear_kernels, 0)
        if levels and use_int8_activations(model, A8_MIN_TOKENS, levels):
            model.a8_min_tokens, model.a8_levels = A8_MIN_TOKENS, levels
        if linear_kernels in AMX_CHOICES and amx_available() and amx_matches_panels() and \
                use_amx(model, AMX_MIN_TOKENS):
            model.amx_min_tokens = AMX_MIN_TOKENS
        if linear_kernels in VNNI_CHOICES and vnni_available() and use_vnni(model, VNNI_MAX_TOKENS):
            model.vnni_max_tokens = VNNI_MAX_TOKENS
        model.batch_invariant = True   # every own path is one scheme for every token count (no GEMM path)
        model.linear_path = linear_path_of(model)

    release_freed_heap()
    return model


def release_freed_heap() -> None:
    """Give the heap pages freed by loading back to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Loading frees many temporaries of a few MB (dequantized blocks, repacked codes) that glibc keeps in its heap
    below its mmap threshold; without this the RSS after loading the embedded GGUF as int4 stays 150 MiB above
    what the weights take (measured: 341 -> 187 MiB; fp32: 635 -> 559 MiB).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
