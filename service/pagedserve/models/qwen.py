"""The Qwen family: Qwen2/2.5 (bias on Q/K/V only), Qwen3 (per-head q/k RMSNorm before rotary, explicit
``head_dim``, biases from ``attention_bias``) and Qwen3-MoE (Qwen3's attention; a mixture of ``num_experts``
experts of ``moe_intermediate_size`` on every ``decoder_sparse_step``-th layer outside ``mlp_only_layers``, top-k
renormalized when ``norm_topk_prob``: :mod:`.moe`), after HF transformers' ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.
Sliding-window layers (``use_sliding_window``; ``layer_types``, from ``max_window_layers`` on) pass their window to
the attention backend."""
from __future__ import annotations

from .decoder import DecoderForCausalLM, DecoderSpec, llama_biases
from .moe import moe_spec_from


class Qwen2ForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)


class Qwen3ForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(**llama_biases(cfg), qk_norm="head")


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        step, dense = int(getattr(cfg, "decoder_sparse_step", 1) or 1), set(getattr(cfg, "mlp_only_layers", []) or [])
        sparse = tuple(i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0
                       for i in range(cfg.num_hidden_layers))
        moe = moe_spec_from(cfg, "num_experts", "moe_intermediate_size", bool(getattr(cfg, "norm_topk_prob", False)),
                            sparse)
        return DecoderSpec(**llama_biases(cfg), qk_norm="head", moe=moe)
