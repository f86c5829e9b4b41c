"""Tiny HF models written to GGUF files the way llama.cpp's ``convert_hf_to_gguf.py`` writes them (its metadata keys,
gguf-py's own HF -> GGUF tensor-name map, llama's Q/K row permutation, Gemma's ``w + 1`` norms, Qwen3-MoE's experts
stacked ``[experts, N, K]``, F32 norms and router), F32, F16 or one quantized type for the 2-D weights
(``gguf.quants.quantize``), and the reference model holding the values that file stores (:func:`stored_model`).
Used by tests/models/test_gguf_families.py."""
from __future__ import annotations

import copy
import math
import re

import numpy as np
import torch

_GEMMA2 = dict(tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
#: llama.cpp's Gemma 3: layers 0-4 local, 5 global (sliding_window_pattern 6), local rope base 10000
_GEMMA3 = dict(num_hidden_layers=6, tie_word_embeddings=True, layer_types=["sliding_attention"] * 5 + ["full_attention"])

#: label -> (GGUF ``general.architecture``, family_cases label, config overrides, file type of the 2-D weights,
#: oracle). Oracle "transformers": transformers' own GGUF reader gets the config right for these overrides (it does
#: not read Qwen3's head_dim, Qwen3-MoE's expert size, Phi-3's rotary dimensions, Gemma's softmax scale, softcaps or
#: rope scaling, so those cases use its defaults: head_dim 128, experts of 768, full rotary, head_dim 256 with
#: Gemma's defaults); "stored": the source model holding the stored values (:func:`stored_model`).
CASES = {
    "llama": ("llama", "llama", {}, "F32", "transformers"),
    "llama-q8": ("llama", "llama", {}, "Q8_0", "transformers"),
    "qwen2-f16": ("qwen2", "qwen2", {}, "F16", "transformers"),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=128), "F32", "transformers"),
    "qwen3-q4": ("qwen3", "qwen3", dict(head_dim=128), "Q4_0", "transformers"),
    "qwen3moe-q8": ("qwen3moe", "qwen3-moe", dict(mlp_only_layers=[], moe_intermediate_size=768), "Q8_0",
                    "transformers"),
    "qwen3moe-small-q4": ("qwen3moe", "qwen3-moe", dict(mlp_only_layers=[]), "Q4_0", "stored"),
    "phi3": ("phi3", "phi3", dict(partial_rotary_factor=1.0), "F32", "transformers"),
    "phi3-partial-q4": ("phi3", "phi3", {}, "Q4_0", "stored"),
    # rope scaling stored as tensors: llama3's frequency divisors (rope_freqs), Phi-3's longrope factors
    "llama3-rope-q8": ("llama", "llama3-rope", {}, "Q8_0", "stored"),
    # Mixtral: llama with experts (llama.cpp writes it so); transformers' reader maps no experts for llama
    "mixtral-q4": ("llama", "mixtral", {}, "Q4_0", "stored"),
    "phi3-longrope": ("phi3", "phi3-longrope", {}, "F32", "stored"),
    "gemma2": ("gemma2", "gemma2", dict(_GEMMA2, head_dim=256, query_pre_attn_scalar=256, sliding_window=24,
                                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0), "F32",
               "transformers"),
    "gemma2-softcap-q8": ("gemma2", "gemma2", dict(_GEMMA2, query_pre_attn_scalar=16), "Q8_0", "stored"),
    "gemma3": ("gemma3", "gemma3", dict(_GEMMA3, head_dim=256, query_pre_attn_scalar=256, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}), "F32", "transformers"),
    "gemma3-linear-q4": ("gemma3", "gemma3", dict(_GEMMA3, query_pre_attn_scalar=16), "Q4_0", "stored"),
}


def case_model(label: str, **more) -> torch.nn.Module:
    """The seeded random HF model of case ``label`` (family_cases' init scale)."""
    from family_cases import hf_config, random_model

    _, family, overrides, _, _ = CASES[label]
    return random_model(hf_config(family, **{**overrides, **more}))


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF (neox) rows -> llama.cpp's interleaved rows per head (its ``LlamaModel.permute``)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(model, arch: str) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor (HF layout) of ``model`` as llama.cpp's converter makes them."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    out = {}
    for hf_name, t in model.state_dict().items():
        t = t.detach().float().clone()
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in hf_name:   # transformers 5 fuses experts: gate_up [E, 2I, H], down [E, H, I]
            base = hf_name.rsplit(".", 1)[0]
            if hf_name.endswith("gate_up_proj"):
                half = t.shape[1] // 2
                out[names.get_name(f"{base}.gate_proj") + ".weight"] = t[:, :half]
                out[names.get_name(f"{base}.up_proj") + ".weight"] = t[:, half:]
            else:
                out[names.get_name(f"{base}.down_proj") + ".weight"] = t
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        if arch == "llama" and stem.endswith((".q_proj", ".k_proj")):
            t = _permute(t, cfg.num_attention_heads if stem.endswith("q_proj") else cfg.num_key_value_heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            t = t + 1.0
        out[f"{names.get_name(stem)}.{suffix}"] = t
    return out


def rope_tensors(cfg, arch: str) -> dict[str, np.ndarray]:
    """The rope tensors llama.cpp's converter adds: llama3's per-frequency divisors (``rope_freqs``: 1 at short
    wavelengths, ``factor`` at long ones, ``1 / ((1 - s) / factor + s)`` between) and longrope's factor lists."""
    import math

    rope = cfg.rope_parameters
    if arch == "llama" and rope.get("rope_type") == "llama3":
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        original = rope["original_max_position_embeddings"]
        out = []
        for i in range(0, d, 2):
            wavelen = 2 * math.pi * rope["rope_theta"] ** (i / d)
            s = (original / wavelen - low) / (high - low)
            out.append(1.0 if wavelen < original / high else factor if wavelen > original / low
                       else 1 / ((1 - s) / factor + s))
        return {"rope_freqs.weight": np.array(out, dtype=np.float32)}
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    return {}


def _kept_float(name: str, t: torch.Tensor) -> bool:
    """What llama.cpp's converter keeps F32 whatever the file type: 1-D tensors and the MoE router."""
    return t.dim() == 1 or "ffn_gate_inp" in name


def _metadata(w, cfg, arch: str) -> None:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":
        if rope.get("rope_type") == "longrope":   # the cos/sin scale transformers computes for it
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
                cfg.original_max_position_embeddings)))
        w.add_rope_dimension_count(int(cfg.partial_rotary_factor * head_dim))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if arch == "llama":
            w.add_rope_dimension_count(head_dim)
    if arch == "llama" and getattr(cfg, "num_local_experts", None):   # Mixtral as llama
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _add(w, name: str, a: np.ndarray, qtype: str, keep_float: bool) -> np.ndarray:
    """Write float32 ``a`` as ``name`` in ``qtype`` (F32 where ``keep_float``); returns the values stored."""
    import gguf
    from gguf.quants import dequantize, quantize

    if keep_float or qtype == "F32":
        w.add_tensor(name, a)
        return a
    if qtype == "F16":
        w.add_tensor(name, a.astype(np.float16))
        return a.astype(np.float16).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    q = quantize(a, kind)
    w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
    return dequantize(q, kind).reshape(a.shape)


def write_gguf(model, arch: str, path, qtype: str = "F32", extra=None, tensors=None,
               legacy_experts: bool = False) -> dict[str, torch.Tensor]:
    """Write ``model`` as a GGUF file at ``path`` with its 2-D weights (3-D experts) in ``qtype`` (F32, F16,
    Q8_0, Q4_0, Q4_1); ``extra(writer)`` may add metadata, ``tensors`` (GGUF name -> float32 array, or ``(raw
    bytes, GGMLQuantizationType)``) replaces or adds tensors; ``legacy_experts`` writes each expert as its own 2-D
    tensor (``blk.N.ffn_gate.E.weight``, the older converters' Mixtral layout). Returns the float32 values stored,
    by GGUF name (experts stacked)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, model.config, arch)
    if extra is not None:
        extra(w)
    stored = {}
    for name, t in gguf_tensors(model, arch).items():
        if name in (tensors or {}):
            continue
        a, keep = t.numpy().astype(np.float32), _kept_float(name, t)
        split = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", name) if legacy_experts else None
        if split:
            a = np.stack([_add(w, f"blk.{split[1]}.ffn_{split[2]}.{e}.weight", a[e], qtype, keep)
                          for e in range(a.shape[0])])
        else:
            a = _add(w, name, a, qtype, keep)
        stored[name] = torch.from_numpy(np.array(a, dtype=np.float32))
    for name, value in {**rope_tensors(model.config, arch), **(tensors or {})}.items():
        if isinstance(value, tuple):
            w.add_tensor(name, value[0], raw_shape=value[0].shape, raw_dtype=value[1])
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def stored_model(model, arch: str, stored: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of HF ``model`` holding the values the GGUF file stores (``stored``, from :func:`write_gguf`), put
    back in HF layout by this module's own inverse of each transform (the experts re-fused, llama's Q/K rows
    un-interleaved, Gemma's norms minus 1 in float32 as transformers reads them): the oracle of a quantized file."""
    import gguf

    ref = copy.deepcopy(model)
    cfg = model.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    state = ref.state_dict()
    with torch.no_grad():
        for hf_name, dst in state.items():
            if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if ".mlp.experts." in hf_name:
                base = hf_name.rsplit(".", 1)[0]
                parts = ["gate_proj", "up_proj"] if hf_name.endswith("gate_up_proj") else ["down_proj"]
                dst.copy_(torch.cat([stored[names.get_name(f"{base}.{p}") + ".weight"] for p in parts], dim=1))
                continue
            stem, suffix = hf_name.rsplit(".", 1)
            t = stored[f"{names.get_name(stem)}.{suffix}"]
            if arch == "llama" and stem.endswith((".q_proj", ".k_proj")):
                heads = cfg.num_attention_heads if stem.endswith("q_proj") else cfg.num_key_value_heads
                d = t.shape[0] // heads
                t = t.reshape(heads, d // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
            if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
                t = t - 1.0
            dst.copy_(t)
    return ref.eval()
