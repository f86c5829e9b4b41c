"""The Llama family (Llama 1-3.x, Mistral, SmolLM/SmolLM2): :class:`~.decoder.DecoderForCausalLM` with Llama's
options (HF transformers' ``LlamaForCausalLM`` / ``MistralForCausalLM``). Rope scaling (``linear``, ``dynamic``,
``llama3``, ``yarn``) comes from :mod:`.rope`; Mistral's ``sliding_window`` is run by the attention backends
(:func:`~.config_checks.layer_windows`). Llama itself ignores a ``sliding_window`` field, as transformers does."""
from __future__ import annotations

from .decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """HF ``LlamaForCausalLM``: biases from ``attention_bias`` (Q/K/V and output) and ``mlp_bias``."""


class MistralForCausalLM(DecoderForCausalLM):
    """HF ``MistralForCausalLM``: Llama's layers; ``sliding_window`` on every layer."""
    sliding_window_attention = True
