"""The Qwen family: Qwen2/2.5 (bias on Q/K/V only) and Qwen3 (per-head q/k RMSNorm before rotary, explicit
``head_dim``, biases from ``attention_bias``), after HF transformers' ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``.
Sliding-window layers (``use_sliding_window`` with ``layer_types``) cap the context at the window."""
from __future__ import annotations

from .config_checks import require, window_limit
from .decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_of(cls, cfg) -> DecoderSpec:
        require(cfg, "hidden_act", ("silu",), "the MLP runs SwiGLU")
        return DecoderSpec(qkv_bias=True).capped(*window_limit(cfg))


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_of(cls, cfg) -> DecoderSpec:
        require(cfg, "hidden_act", ("silu",), "the MLP runs SwiGLU")
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm="head").capped(*window_limit(cfg))
