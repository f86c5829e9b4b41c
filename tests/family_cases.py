"""Tiny seeded random checkpoints of every registered decoder family (HF config classes, ``save_pretrained``), shared by
tests/models/test_families.py (exactness against transformers) and tests/models/test_family_refusals.py."""
from __future__ import annotations

import torch

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0] * 6}

#: label -> (transformers config class, overrides, expected HF architecture)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "LlamaForCausalLM"),
    "llama-bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True), "LlamaForCausalLM"),
    "llama3-rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}), "LlamaForCausalLM"),
    "linear-rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "LlamaForCausalLM"),
    "dynamic-rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "LlamaForCausalLM"),
    "yarn-rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 128}), "LlamaForCausalLM"),
    "mistral": ("MistralConfig", dict(sliding_window=None), "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", {}, "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", {}, "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, sliding_window=None, head_dim=None), "Phi3ForCausalLM"),
    "phi3-longrope": ("Phi3Config", dict(partial_rotary_factor=0.75, sliding_window=None, head_dim=None,
                                         original_max_position_embeddings=128, rope_scaling=LONGROPE),
                      "Phi3ForCausalLM"),
    "granite": ("GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                      logits_scaling=4.0), "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", {}, "Olmo2ForCausalLM"),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0, 1]), "SmolLM3ForCausalLM"),
}


def hf_config(label: str, **more):
    import transformers

    cls, overrides, _ = FAMILIES[label]
    kw = {**BASE, **overrides, **more}
    if kw.get("head_dim") is None:
        kw.pop("head_dim", None)
    return getattr(transformers, cls)(**kw)


def save_random_checkpoint(cfg, path) -> torch.nn.Module:
    """HF's own model of ``cfg`` with seeded random weights, saved to ``path``; returns it (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    return model
