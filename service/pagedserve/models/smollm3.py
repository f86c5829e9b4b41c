"""SmolLM3 (HF transformers' ``SmolLM3ForCausalLM``): Llama's layers, rotary only where ``no_rope_layers[i]`` is 1
(every fourth layer is a NoPE layer in the released model); sliding-window layers cap the context at the window."""
from __future__ import annotations

from .config_checks import UnsupportedConfig, require, window_limit
from .decoder import DecoderForCausalLM, DecoderSpec


class SmolLM3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_of(cls, cfg) -> DecoderSpec:
        require(cfg, "hidden_act", ("silu",), "the MLP runs SwiGLU")
        rope = getattr(cfg, "no_rope_layers", None)
        if rope is not None and len(rope) != cfg.num_hidden_layers:
            raise UnsupportedConfig(f"no_rope_layers has {len(rope)} entries for {cfg.num_hidden_layers} layers")
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
                           rope_layers=None if rope is None else tuple(bool(r) for r in rope)
                           ).capped(*window_limit(cfg))
