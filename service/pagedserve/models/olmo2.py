"""OLMo 2 (HF transformers' ``Olmo2ForCausalLM``): no norm before the sublayers; RMSNorm of each sublayer's output
before its residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``), and q/k RMSNorm over the
whole q and k projections before rotary (so it runs at tensor-parallel size 1 only)."""
from __future__ import annotations

from .config_checks import require, window_limit
from .decoder import DecoderForCausalLM, DecoderSpec


class Olmo2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_of(cls, cfg) -> DecoderSpec:
        require(cfg, "hidden_act", ("silu",), "the MLP runs SwiGLU")
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm="projection",
                           norm_layout="post").capped(*window_limit(cfg))
