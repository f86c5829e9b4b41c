"""The GGUF architectures this engine runs (:data:`GGUF_ARCHITECTURES`; llama files with experts, llama.cpp's
Mixtral: :data:`GGUF_MOE_VARIANTS`) and the HF config a GGUF file's metadata makes (:func:`gguf_config`).

Each ``general.architecture`` is read as llama.cpp's ``convert_hf_to_gguf.py`` writes it (the ``{arch}.*`` keys of
gguf-py's ``constants.Keys``; the tensor names of its ``MODEL_TENSORS``) and as llama.cpp's ``llama-model.cpp``
runs it where the file is silent (Gemma's softcaps, window pattern and local rope base; Qwen3-MoE's renormalized
top-k), into the transformers config class of the family that runs it. transformers' own GGUF reader
(``integrations/ggml.py`` ``GGUF_CONFIG_MAPPING``) reads fewer keys (Qwen3's ``head_dim``, Gemma's
``query_pre_attn_scalar``, softcaps and rope scaling fall back to its config defaults); where both read a key they
agree. A metadata key of the architecture this module does not read, a value the engine cannot run exactly or an
architecture it does not know is refused with a ValueError naming the key (``general.architecture='mamba' is not
supported``), before any tensor is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .gguf_rope import rope_from_tensors

#: ``{arch}.*`` keys every architecture reads (gguf-py ``Keys.LLM`` / ``Keys.Attention`` / ``Keys.Rope``).
_COMMON_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
    "attention.value_length", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.finetuned"})   # finetuned: whether the scaled model was trained so; llama.cpp only reports it

#: keys every file of these architectures carries (llama.cpp's converter writes them all)
_REQUIRED = ("context_length", "embedding_length", "block_count", "attention.head_count",
             "attention.layer_norm_rms_epsilon")

_ATTN = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: 3-D ``[experts, N, K]`` tensors are split per expert (``{e}``); ``ffn_gate_inp`` is the router
_EXPERTS = {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
            "ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
            "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_PHI3 = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
_GEMMA = {**_ATTN, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one ``general.architecture`` maps onto a family.

    Attributes: ``hf_architecture`` (the :data:`~.registry.MODEL_REGISTRY` name that runs it), ``config_class``
    (the transformers config class built), ``layer_tensors`` (GGUF ``blk.N.<name>`` -> HF ``model.layers.N.<name>``),
    ``keys`` (the ``{arch}.*`` metadata keys read beyond :data:`_COMMON_KEYS`), ``permute_qk`` (llama.cpp's
    ``LlamaModel`` converter interleaved each Q/K head's rows for GPT-J-style rotary; undone as read),
    ``norm_shift`` (Gemma's converter stores RMSNorm weights as ``w + 1``; transformers' ``Gemma2TensorProcessor``
    subtracts 1, and so does the loader), ``head_dim_field`` (the config class takes ``head_dim``).
    """

    hf_architecture: str
    config_class: str
    layer_tensors: dict[str, str]
    keys: frozenset[str] = field(default_factory=frozenset)
    permute_qk: bool = False
    norm_shift: float = 0.0
    head_dim_field: bool = True


_SWA = frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})

#: ``general.architecture`` -> how it runs. The README's "GGUF files" table lists exactly these
#: (tests/unit/models/test_gguf_table.py).
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "LlamaConfig", {**_ATTN, **_MLP},
                              frozenset({"expert_count", "expert_used_count"}), permute_qk=True),   # counts of 0
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "Qwen2Config", {**_ATTN, **_MLP}, head_dim_field=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "Qwen3Config", {**_ATTN, **_QK_NORM, **_MLP}),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {**_ATTN, **_QK_NORM, **_EXPERTS},
                                 frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length",
                                            "expert_weights_norm"})),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", "Phi3Config", _PHI3,
                             frozenset({"attention.sliding_window", "rope.scaling.original_context_length",
                                        "rope.scaling.attn_factor"}),
                             head_dim_field=False),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", "Gemma2Config", _GEMMA,
                               _SWA | {"attn_logit_softcapping", "final_logit_softcapping"}, norm_shift=1.0),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", "Gemma3TextConfig", {**_GEMMA, **_QK_NORM},
                               _SWA | {"rope.freq_base_swa"}, norm_shift=1.0),
}

#: ``general.architecture`` -> the family its files run as when ``{arch}.expert_count`` > 0: llama.cpp writes Mixtral
#: as ``llama`` (its ``LlamaModel`` converter stacks the experts into ``ffn_*_exps``; the graph renormalizes the
#: top-k and ignores Mistral's window). The README's table lists it as ``llama`` with ``llama.expert_count``.
GGUF_MOE_VARIANTS: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("MixtralForCausalLM", "MixtralConfig", {**_ATTN, **_EXPERTS},
                              frozenset({"expert_count", "expert_used_count"}), permute_qk=True),
}

#: llama.cpp ``llama-model.cpp``: every n-th layer global (``set_swa_pattern``), the local layers' rope base, and the
#: layer count of the 27B models whose softmax scale is ``(hidden / heads) ** -0.5`` instead of ``head_dim ** -0.5``
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _refuse(key: str, value, why: str) -> ValueError:
    return ValueError(f"{key}={value!r}: {why}")


def metadata(reader) -> dict[str, object]:
    """The metadata keys of a ``gguf.GGUFReader`` with their values (scalars, strings, lists), except the
    tokenizer's arrays (vocabulary, merges, scores: the tokenizer reads them), of which ``<key>.count`` gives the
    length."""
    from gguf import GGUFValueType

    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.") and f.types and f.types[0] == GGUFValueType.ARRAY:
            out[f"{key}.count"] = len(f.data)
        else:
            out[key] = f.contents()
    return out


def architecture_of_gguf(meta: dict) -> tuple[str, GGUFArchitecture]:
    """``(general.architecture, its GGUFArchitecture)`` (:data:`GGUF_MOE_VARIANTS` where it has experts).

    Raises:
        ValueError: an architecture not in :data:`GGUF_ARCHITECTURES`, named (``general.architecture='mamba' is
            not supported (supported: [...])``).
    """
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(f"general.architecture={name!r} is not supported (supported: {sorted(GGUF_ARCHITECTURES)})")
    if name in GGUF_MOE_VARIANTS and int(meta.get(f"{name}.expert_count") or 0) > 0:
        return name, GGUF_MOE_VARIANTS[name]
    return name, GGUF_ARCHITECTURES[name]


def _int(hp: dict, key: str, arch: str, default=None) -> int | None:
    value = hp.get(key, default)
    if isinstance(value, list):
        raise _refuse(f"{arch}.{key}", value, "per-layer values are not supported")
    return None if value is None else int(value)


def _rope(hp: dict, arch: str) -> dict:
    theta = float(hp.get("rope.freq_base", 10000.0))
    kind = hp.get("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(hp["rope.scaling.factor"]), "rope_theta": theta}
    raise _refuse(f"{arch}.rope.scaling.type", kind, "only 'none' and 'linear' are read from GGUF files")


def _layer_types(hp: dict, arch: str, n: int) -> list[str]:
    pattern = hp.get("attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):   # per layer: True where the layer is local
        if len(pattern) != n:
            raise _refuse(f"{arch}.attention.sliding_window_pattern", pattern, f"must have {n} entries")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    p = int(pattern)
    return ["sliding_attention" if p and i % p < p - 1 else "full_attention" for i in range(n)]


def config_kwargs(meta: dict, tensors: dict) -> tuple[GGUFArchitecture, dict]:
    """The config class's keyword arguments from a GGUF file's ``meta`` (:func:`metadata`) and its tensors (name ->
    ``gguf.ReaderTensor``; only the rope tensors of :mod:`.gguf_rope` are read, the others by name and shape).

    Raises:
        ValueError: an unknown architecture; an ``{arch}.*`` key this module does not read, or one of
            :data:`_REQUIRED` missing; per-layer head counts;
            ``value_length`` != ``key_length``; a rope scaling type other than none/linear; rotary dimensions other
            than the head size (Phi-3: a partial rotary factor); a ``head_dim`` a config class without that field
            cannot hold; rope tensors that do not fit (:func:`.gguf_rope.rope_from_tensors`).
    """
    arch, spec = architecture_of_gguf(meta)
    hp = {k[len(arch) + 1:]: v for k, v in meta.items() if k.startswith(arch + ".")}
    for key in sorted(set(hp) - _COMMON_KEYS - spec.keys):
        raise _refuse(f"{arch}.{key}", hp[key], f"not read by the engine's GGUF {arch} support, so it cannot be run "
                                                f"exactly")
    for key in _REQUIRED:
        if key not in hp:
            raise ValueError(f"{arch}.{key} is missing from the GGUF metadata")
    hidden, heads = _int(hp, "embedding_length", arch), _int(hp, "attention.head_count", arch)
    kv_heads = _int(hp, "attention.head_count_kv", arch, heads)
    head_dim = _int(hp, "attention.key_length", arch, hidden // heads)
    if _int(hp, "attention.value_length", arch, head_dim) != head_dim:
        raise _refuse(f"{arch}.attention.value_length", hp["attention.value_length"],
                      f"must equal attention.key_length ({head_dim})")
    if not spec.head_dim_field and head_dim != hidden // heads:
        raise _refuse(f"{arch}.attention.key_length", head_dim, f"{spec.config_class} has head_dim = "
                                                                f"embedding_length / head_count ({hidden // heads})")
    vocab = hp.get("vocab_size") or meta.get("tokenizer.ggml.tokens.count") or \
        (int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors else None)
    layers = _int(hp, "block_count", arch)
    kw = dict(architectures=[spec.hf_architecture], hidden_size=hidden, num_attention_heads=heads,
              num_key_value_heads=kv_heads, num_hidden_layers=layers,
              intermediate_size=_int(hp, "feed_forward_length", arch, 4 * hidden),
              max_position_embeddings=_int(hp, "context_length", arch),
              rms_norm_eps=float(hp["attention.layer_norm_rms_epsilon"]),
              tie_word_embeddings="output.weight" not in tensors, rope_parameters=_rope(hp, arch))
    if vocab is not None:
        kw["vocab_size"] = int(vocab)
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        if f"tokenizer.ggml.{theirs}" in meta:
            kw[ours] = int(meta[f"tokenizer.ggml.{theirs}"])
    if spec.head_dim_field:
        kw["head_dim"] = head_dim
    rotary = _int(hp, "rope.dimension_count", arch, head_dim)
    if arch == "phi3" and rotary != head_dim:
        kw["partial_rotary_factor"] = rotary / head_dim
    elif rotary != head_dim:
        raise _refuse(f"{arch}.rope.dimension_count", rotary, f"partial rotary is not read for {arch} (head size "
                                                              f"{head_dim})")
    kw["rope_parameters"] = rope_from_tensors(arch, hp, tensors, kw["rope_parameters"], head_dim, rotary)
    moe = spec.hf_architecture == "MixtralForCausalLM"
    if moe:
        kw.update(num_local_experts=_int(hp, "expert_count", arch), num_experts_per_tok=_int(hp, "expert_used_count",
                                                                                          arch), sliding_window=None)
    elif arch in ("llama", "qwen3", "qwen3moe", "gemma2", "gemma3"):
        kw["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama" and not moe:
        kw["mlp_bias"] = "blk.0.ffn_down.bias" in tensors
    if arch == "qwen3moe":   # llama.cpp's qwen3moe graph renormalizes the top-k unless the file says otherwise
        kw.update(num_experts=_int(hp, "expert_count", arch), num_experts_per_tok=_int(hp, "expert_used_count", arch),
                  moe_intermediate_size=_int(hp, "expert_feed_forward_length", arch),
                  norm_topk_prob=bool(hp.get("expert_weights_norm", True)), decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "phi3":
        window = _int(hp, "attention.sliding_window", arch, 0)
        kw.update(sliding_window=window or None, original_max_position_embeddings=_int(
            hp, "rope.scaling.original_context_length", arch, kw["max_position_embeddings"]))
    if arch in _GEMMA_PATTERN:
        big = layers == _GEMMA_27B_LAYERS[arch]
        kw.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=hidden // heads if big else head_dim,
                  sliding_window=_int(hp, "attention.sliding_window", arch, 4096),
                  layer_types=_layer_types(hp, arch, layers))
    if arch == "gemma2":   # llama.cpp's defaults where the file has no softcaps (Gemma 2's released values)
        kw.update(attn_logit_softcapping=float(hp.get("attn_logit_softcapping", 50.0)),
                  final_logit_softcapping=float(hp.get("final_logit_softcapping", 30.0)))
    if arch == "gemma3":
        kw.update(attn_logit_softcapping=None, final_logit_softcapping=None, rope_parameters={
            "full_attention": kw["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": float(hp.get("rope.freq_base_swa", 10000.0))}})
    return spec, kw


def gguf_config(path: str):
    """The transformers config (:attr:`GGUFArchitecture.config_class`) of the GGUF file at ``path``; its
    ``architectures`` names the family that runs it.

    Raises:
        ValueError: see :func:`config_kwargs`.
    """
    import transformers
    from gguf import GGUFReader

    reader = GGUFReader(path)
    spec, kw = config_kwargs(metadata(reader), {t.name: t for t in reader.tensors})
    return getattr(transformers, spec.config_class)(**kw)
