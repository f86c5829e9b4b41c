"""SmolLM3 (HF transformers' ``SmolLM3ForCausalLM``): Llama's layers, rotary only where ``no_rope_layers[i]`` is 1
(every fourth layer is a NoPE layer in the released model); sliding-window layers (``layer_types``) pass their window
to the attention backend."""
from __future__ import annotations

from .config_checks import UnsupportedConfig
from .decoder import DecoderForCausalLM, DecoderSpec, llama_biases


class SmolLM3ForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        rope = getattr(cfg, "no_rope_layers", None)
        if rope is not None and len(rope) != cfg.num_hidden_layers:
            raise UnsupportedConfig(f"no_rope_layers has {len(rope)} entries for {cfg.num_hidden_layers} layers")
        return DecoderSpec(**llama_biases(cfg), rope_layers=None if rope is None else tuple(bool(r) for r in rope))
