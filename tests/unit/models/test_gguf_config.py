"""The config a GGUF file's metadata makes where the file is silent: llama.cpp's runtime defaults (llama-model.cpp),
on metadata dicts alone (no file, no model)."""
from __future__ import annotations

import pytest


class _Tensor:
    def __init__(self, *shape):
        self.shape = shape


def _meta(arch: str, **more) -> dict:
    base = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.block_count": 6,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.context_length": 512,
            f"{arch}.feed_forward_length": 128}
    meta = {**base, **{f"{arch}.{k.replace('__', '.')}": v for k, v in more.items()}}
    return {k: v for k, v in meta.items() if v is not None}


def test_vocab_size_from_the_tokenizer_then_the_embedding():
    from pagedserve.models.gguf_arch import config_kwargs

    _, kw = config_kwargs({**_meta("llama"), "tokenizer.ggml.tokens.count": 300}, {})
    assert kw["vocab_size"] == 300
    _, kw = config_kwargs(_meta("llama"), {"token_embd.weight": _Tensor(64, 200)})   # GGUF order: [K, N]
    assert kw["vocab_size"] == 200 and kw["tie_word_embeddings"] and kw["head_dim"] == 16


def test_gemma_defaults_are_llama_cpps():
    """Gemma 2 without softcaps: 50 / 30; windows alternate from layer 0; a 4096 window; the softmax scale from
    ``head_dim``, from ``hidden / heads`` at the 27B's layer count; Gemma 3: every 6th layer global, local rope
    base 10000, linear scaling on the global layers only."""
    from pagedserve.models.gguf_arch import config_kwargs

    _, kw = config_kwargs(_meta("gemma2", attention__key_length=32), {})
    assert (kw["attn_logit_softcapping"], kw["final_logit_softcapping"], kw["sliding_window"]) == (50.0, 30.0, 4096)
    assert kw["layer_types"] == ["sliding_attention", "full_attention"] * 3
    assert kw["query_pre_attn_scalar"] == 32 and kw["head_dim"] == 32
    _, kw = config_kwargs(_meta("gemma2", attention__key_length=32, block_count=46), {})
    assert kw["query_pre_attn_scalar"] == 16
    _, kw = config_kwargs(_meta("gemma3", attention__sliding_window=512, rope__scaling__type="linear",
                                rope__scaling__factor=8.0, rope__freq_base=1e6), {})
    assert kw["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert kw["rope_parameters"] == {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert kw["attn_logit_softcapping"] is None and kw["final_logit_softcapping"] is None


def test_qwen3moe_renormalizes_unless_the_file_says_not():
    from pagedserve.models.gguf_arch import config_kwargs

    experts = dict(expert_count=8, expert_used_count=2, expert_feed_forward_length=32)
    _, kw = config_kwargs(_meta("qwen3moe", **experts), {})
    assert (kw["num_experts"], kw["num_experts_per_tok"], kw["moe_intermediate_size"]) == (8, 2, 32)
    assert kw["norm_topk_prob"] is True and kw["mlp_only_layers"] == [] and kw["decoder_sparse_step"] == 1
    _, kw = config_kwargs(_meta("qwen3moe", expert_weights_norm=False, **experts), {})
    assert kw["norm_topk_prob"] is False


@pytest.mark.parametrize("arch, more, message", [
    ("llama", dict(attention__head_count_kv=[2, 2, 2, 2, 2, 2]), r"^llama.attention.head_count_kv=\[2, 2"),
    ("qwen3", dict(attention__key_length=16, attention__value_length=32), r"^qwen3.attention.value_length=32: "),
    ("qwen2", dict(attention__key_length=32), r"^qwen2.attention.key_length=32: Qwen2Config has head_dim = "),
    ("phi3", dict(block_count=None), r"^phi3.block_count is missing from the GGUF metadata"),
])
def test_shapes_the_families_cannot_hold_refused(arch, more, message):
    from pagedserve.models.gguf_arch import config_kwargs

    with pytest.raises(ValueError, match=message):
        config_kwargs(_meta(arch, **more), {})
