"""Gemma 2 and Gemma 3 text (HF transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``; Gemma Team 2024, 2025).

Llama's decoder with Gemma's options (:class:`~.decoder_spec.DecoderSpec`):
- RMSNorm scaling by ``1 + weight`` (HF ``Gemma2RMSNorm``): the checkpoint's norm weights get 1 added as read, so
  every backend's RMSNorm runs them unchanged. Exact in float32; in bfloat16 HF multiplies by ``1 + w`` in float32
  where the loaded weight is ``1 + w`` rounded to bfloat16.
- a norm before and after each sublayer (``norm_layout="sandwich"``), embeddings scaled by ``sqrt(hidden_size)``,
  GeGLU with tanh-approximated GELU (``hidden_activation="gelu_pytorch_tanh"``), the softmax scale
  ``query_pre_attn_scalar ** -0.5``, tied embeddings as the checkpoint says;
- Gemma 2: soft-capped attention scores (``attn_logit_softcapping``) and logits (``final_logit_softcapping``),
  sliding-window layers by ``layer_types`` (alternating in the released models);
- Gemma 3: per-head q/k RMSNorm (``1 + w`` too), local layers (``sliding_attention``) rotated with their own rope
  parameters (``rope_parameters["sliding_attention"]``, from ``rope_local_base_freq``) and global layers with
  ``rope_parameters["full_attention"]`` (``linear`` scaling in the released 4B-27B), soft-capping where the config
  sets it.

Refused at start-up naming the field: ``use_bidirectional_attention`` (Gemma 3's embedding variant),
``hidden_activation`` other than the tanh GELU.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from .config_checks import UnsupportedConfig, require
from .decoder import DecoderForCausalLM, DecoderSpec
from .rope import rope_parameters

_NORMS = ("layernorm.weight", "norm.weight")   # input/post_attention/pre_/post_feedforward, q/k and final norms


def gemma_spec(cfg, qk_norm: str) -> DecoderSpec:
    """The options Gemma 2 and 3 share, read from ``cfg``."""
    require(cfg, "hidden_activation", ("gelu_pytorch_tanh",), "the MLP runs GeGLU with the tanh GELU")
    if getattr(cfg, "use_bidirectional_attention", None):
        raise UnsupportedConfig("use_bidirectional_attention=True: the engine runs causal attention only")
    cap = getattr(cfg, "attn_logit_softcapping", None)
    final = getattr(cfg, "final_logit_softcapping", None)
    return DecoderSpec(qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                       o_bias=bool(getattr(cfg, "attention_bias", False)), qk_norm=qk_norm, norm_layout="sandwich",
                       mlp_act="gelu_tanh", embedding_multiplier=float(cfg.hidden_size) ** 0.5,
                       attention_multiplier=float(cfg.query_pre_attn_scalar) ** -0.5,
                       attn_softcap=None if cap is None else float(cap),
                       final_softcap=None if final is None else float(final))


class Gemma2ForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return gemma_spec(cfg, "none")

    def hf_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        for name, tensor in weights:
            if name.endswith(_NORMS):
                tensor = tensor.float() + 1.0   # Gemma's RMSNorm multiplies by (1 + weight)
            yield name, tensor


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return gemma_spec(cfg, "head")

    @classmethod
    def rope_parameter_sets(cls, cfg):
        """Global layers' parameters first, the local layers' second (transformers 5 keeps them per layer type in
        ``rope_parameters``; older configs give ``rope_theta`` / ``rope_scaling`` for the global layers and
        ``rope_local_base_freq`` for the local ones)."""
        params = getattr(cfg, "rope_parameters", None) or {}
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        if "full_attention" in params or "sliding_attention" in params:
            glob = rope_parameters(_Flat(cfg, params.get("full_attention") or {}))
            local = rope_parameters(_Flat(cfg, params.get("sliding_attention") or {}))
        else:
            glob = rope_parameters(cfg)
            local = {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_local_base_freq", 10000.0))}
        return [glob, local], tuple(1 if t == "sliding_attention" else 0 for t in types)


class _Flat:
    """A config view whose ``rope_parameters`` is one layer type's dict (for :func:`~.rope.rope_parameters`)."""

    def __init__(self, cfg, params: dict):
        self._cfg, self.rope_parameters, self.rope_scaling = cfg, params, None

    def __getattr__(self, name):
        return getattr(self._cfg, name)
