"""The Qwen family: Qwen2/2.5 (bias on Q/K/V only), Qwen3 (per-head q/k RMSNorm before rotary, explicit
``head_dim``, biases from ``attention_bias``) and Qwen3-MoE (Qwen3's attention; a mixture of ``num_experts``
experts of ``moe_intermediate_size`` on every ``decoder_sparse_step``-th layer outside ``mlp_only_layers``, top-k
renormalized when ``norm_topk_prob``: :mod:`.moe`), after HF transformers' ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.
Sliding-window layers (``use_sliding_window`` with ``layer_types``) cap the context at the window."""
from __future__ import annotations

from .config_checks import require, window_limit
from .decoder import DecoderForCausalLM, DecoderSpec
from .moe import moe_spec_from


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


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_of(cls, cfg) -> DecoderSpec:
        require(cfg, "hidden_act", ("silu",), "the experts run SwiGLU")
        bias = bool(getattr(cfg, "attention_bias", False))
        step, dense = int(getattr(cfg, "decoder_sparse_step", 1) or 1), set(getattr(cfg, "mlp_only_layers", []) or [])
        sparse = tuple(i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0
                       for i in range(cfg.num_hidden_layers))
        moe = moe_spec_from(cfg, "num_experts", "moe_intermediate_size", bool(getattr(cfg, "norm_topk_prob", False)),
                            sparse)
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm="head", moe=moe).capped(*window_limit(cfg))
