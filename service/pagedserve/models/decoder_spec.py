"""The options one decoder family sets (:class:`DecoderSpec`), read by :mod:`.decoder` to assemble its layers."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .moe import MoeSpec


@dataclass(frozen=True)
class DecoderSpec:
    """The options a family sets (defaults: Llama).

    Attributes:
        qkv_bias, o_bias, mlp_bias: biases on the fused Q/K/V, the output projection, gate/up and down.
        qk_norm: ``"none"``, ``"head"`` (RMSNorm over each head's ``head_dim`` features, weight ``[head_dim]``,
            before rotary: Qwen3) or ``"projection"`` (RMSNorm over the whole q and k projections, weights
            ``[heads * head_dim]``: OLMo 2).
        norm_layout: ``"pre"`` (norm before each sublayer, Llama), ``"post"`` (norm of each sublayer's output
            before the residual add, no input norm: OLMo 2) or ``"sandwich"`` (both: a norm before and after each
            sublayer, Gemma 2/3's ``input_layernorm`` / ``post_attention_layernorm`` / ``pre_feedforward_layernorm``
            / ``post_feedforward_layernorm``).
        mlp_act: the gated MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU with the tanh
            approximation of GELU, Gemma's ``gelu_pytorch_tanh``).
        attn_softcap: None, or the soft-cap of the attention scores (Gemma 2's ``attn_logit_softcapping``).
        final_softcap: None, or the soft-cap of the logits, ``c * tanh(logits / c)`` (``final_logit_softcapping``).
        attention_sinks: each attention layer has one learned sink logit per head (gpt-oss's ``sinks``).
        rope_layers: per layer whether it rotates q/k (None: every layer).
        embedding_multiplier, residual_multiplier: scale the token embeddings and each sublayer's output.
        attention_multiplier: the softmax scale (None: ``head_dim ** -0.5``).
        logits_scaling: logits are divided by it.
        max_exact_len: tokens up to which the model is exact (None: ``max_position_embeddings``);
            ``max_exact_len_reason`` names the config field behind it.
        moe: the mixture-of-experts layers (:class:`~.moe.MoeSpec`; None: every MLP dense).
        sliding_windows: per layer its sliding window in tokens, None for full attention
            (:func:`~.config_checks.layer_windows`); None: every layer attends to its whole context.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"
    norm_layout: str = "pre"
    rope_layers: tuple[bool, ...] | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    max_exact_len: int | None = None
    max_exact_len_reason: str = ""
    moe: MoeSpec | None = None
    sliding_windows: tuple[int | None, ...] | None = None
    mlp_act: str = "silu"
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attention_sinks: bool = False

    def capped(self, limit: int | None, reason: str) -> DecoderSpec:
        """This spec with ``max_exact_len`` lowered to ``limit`` (None: unchanged)."""
        if limit is None or (self.max_exact_len is not None and self.max_exact_len <= limit):
            return self
        return replace(self, max_exact_len=int(limit), max_exact_len_reason=reason)
