"""Phi-3 / Phi-4-mini (HF transformers' ``Phi3ForCausalLM``): Llama's layers with Q/K/V and gate/up stored fused
in the checkpoint (``qkv_proj``, ``gate_up_proj``; split here into Llama's names as read), rotary over the first
``partial_rotary_factor`` of each head (Phi-4-mini: 0.75) and ``longrope`` scaling (exact up to
``original_max_position_embeddings``, :mod:`.rope`). ``sliding_window`` applies to every layer."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from .decoder import DecoderForCausalLM, DecoderSpec, split_fused


class Phi3ForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec()

    def hf_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        cfg = self.config
        heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        qkv = [("q_proj", heads * d), ("k_proj", kv_heads * d), ("v_proj", kv_heads * d)]
        gate_up = [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)]
        for name, tensor in weights:
            if "self_attn.qkv_proj." in name:
                yield from split_fused(name, tensor, "qkv_proj", qkv)
            elif "mlp.gate_up_proj." in name:
                yield from split_fused(name, tensor, "gate_up_proj", gate_up)
            else:
                yield name, tensor
