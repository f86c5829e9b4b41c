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
    # sliding windows far shorter than the tests' prompts (200 and 260 tokens, prefilled in 64-token chunks)
    "mistral-window": ("MistralConfig", dict(sliding_window=24), "MistralForCausalLM"),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=40, max_window_layers=1),
                     "Qwen2ForCausalLM"),
    "qwen3-window": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=17, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"]), "Qwen3ForCausalLM"),
    "phi3-window": ("Phi3Config", dict(partial_rotary_factor=0.75, sliding_window=33, head_dim=None),
                    "Phi3ForCausalLM"),
    # Gemma 2: soft-capped scores and logits, alternating windows; Gemma 3: q/k norm, local rope base, windows
    "gemma2": ("Gemma2Config", dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=8.0), "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=20, query_pre_attn_scalar=16, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}), "Gemma3ForCausalLM"),
    "gpt-oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=22, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 128, "rope_theta": 150000.0}), "GptOssForCausalLM"),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                "MixtralForCausalLM"),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[1]), "Qwen3MoeForCausalLM"),
    "qwen3-moe-unnormed": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                  norm_topk_prob=False, decoder_sparse_step=2),
                           "Qwen3MoeForCausalLM"),
}


def hf_config(label: str, **more):
    import transformers

    cls, overrides, _ = FAMILIES[label]
    kw = {**BASE, **overrides, **more}
    if kw.get("head_dim") is None:
        kw.pop("head_dim", None)
    return getattr(transformers, cls)(**kw)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of HF model ``hf`` after ``ids``, each from a full forward (the oracle of the engine's)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def engine_greedy(engine, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    """``n`` greedy tokens per prompt through ``engine`` (all added at once, ids ``r0``, ``r1``, ...)."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    return out


def random_model(cfg) -> torch.nn.Module:
    """HF's own model of ``cfg`` with weights seeded by ``torch.manual_seed(0)`` (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def save_random_checkpoint(cfg, path, train_steps: int = 0) -> torch.nn.Module:
    """HF's own model of ``cfg`` with seeded random weights (then ``train_steps`` of :func:`train_briefly`), saved to
    ``path``; returns it (eval mode)."""
    model = random_model(cfg)
    if train_steps:
        train_briefly(model, train_steps)
    model.save_pretrained(path)
    return model


def train_briefly(model: torch.nn.Module, steps: int = 400, seed: int = 0) -> torch.nn.Module:
    """Fit ``model`` (an HF causal LM) for ``steps`` Adam steps on a seeded bigram language (each token has one
    successor, ``succ = perm[token]``), so its predictions are confident as a trained LM's are: a random-weight model's
    top-1 margins are too small to tell a kernel's rounding from a wrong result. Returns it in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    perm = torch.randperm(vocab - 2, generator=gen) + 2
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        tok = torch.randint(2, vocab, (8,), generator=gen)
        seq = [tok]
        for _ in range(63):
            seq.append(perm[seq[-1] - 2])
        ids = torch.stack(seq, dim=1)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
