"""Granite 3.x (HF transformers' ``GraniteForCausalLM``): Llama's layers scaled by ``embedding_multiplier`` (token
embeddings), ``residual_multiplier`` (each sublayer's output before the residual add), ``attention_multiplier``
(the softmax scale, replacing ``head_dim ** -0.5``) and ``logits_scaling`` (logits divided by it)."""
from __future__ import annotations

from .decoder import DecoderForCausalLM, DecoderSpec, llama_biases


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(**llama_biases(cfg),
                           embedding_multiplier=float(getattr(cfg, "embedding_multiplier", 1.0)),
                           residual_multiplier=float(getattr(cfg, "residual_multiplier", 1.0)),
                           attention_multiplier=float(getattr(cfg, "attention_multiplier", 1.0)),
                           logits_scaling=float(getattr(cfg, "logits_scaling", 1.0)))
