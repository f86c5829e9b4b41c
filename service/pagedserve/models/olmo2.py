"""OLMo 2 (HF transformers' ``Olmo2ForCausalLM``): no norm before the sublayers; RMSNorm of each sublayer's output
before its residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``), and q/k RMSNorm over the
whole q and k projections before rotary (under tensor parallelism from each rank's slice, the sum of squares
all-reduced: ``DecoderAttention._sliced_rms_norm``)."""
from __future__ import annotations

from .decoder import DecoderForCausalLM, DecoderSpec, llama_biases


class Olmo2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(**llama_biases(cfg), qk_norm="projection", norm_layout="post")
