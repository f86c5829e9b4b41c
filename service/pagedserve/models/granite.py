"""Granite 3.x (HF transformers' ``GraniteForCausalLM``): Llama's layers scaled by ``embedding_multiplier`` (token
embeddings), ``residual_multiplier`` (each sublayer's output before the residual add), ``attention_multiplier``
(the softmax scale, replacing ``head_dim ** -0.5``) and ``logits_scaling`` (logits divided by it)."""
from __future__ import annotations

from .config_checks import require, window_limit
from .decoder import DecoderForCausalLM, DecoderSpec


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_of(cls, cfg) -> DecoderSpec:
        require(cfg, "hidden_act", ("silu",), "the MLP runs SwiGLU")
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
                           embedding_multiplier=float(getattr(cfg, "embedding_multiplier", 1.0)),
                           residual_multiplier=float(getattr(cfg, "residual_multiplier", 1.0)),
                           attention_multiplier=float(getattr(cfg, "attention_multiplier", 1.0)),
                           logits_scaling=float(getattr(cfg, "logits_scaling", 1.0))).capped(*window_limit(cfg))
