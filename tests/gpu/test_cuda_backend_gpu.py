"""The CUDA attention backend against the torch backend: one mixed step (cache writes and outputs), and greedy
generation through :class:`pagedserve.engine.llm_engine.LLMEngine` on a random-weight Llama of SmolLM2-135M's
shape (30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, ffn 1536, vocab 49152)."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention import select_attention_backend
from pagedserve.attention.torch_ref import TorchAttentionBackend
from paged_batch import ATTN_TOL, blocks_needed, make_caches, make_meta, random_qkv

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cupy")

from pagedserve.attention.cuda import CudaAttentionBackend  # noqa: E402

DEV = torch.device("cuda")


def test_auto_selects_cuda():
    assert isinstance(select_attention_backend("auto", DEV), CudaAttentionBackend)
    assert isinstance(select_attention_backend("cuda", DEV), CudaAttentionBackend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_mixed_step_matches_torch_backend(dtype):
    """Decodes first, then prefill chunks; both backends write the same cache rows and return the same output."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    ctx = [40, 1, 700, 17, 300, 2000]
    q_lens = [1, 1, 1, 17, 45, 512]
    num_blocks = blocks_needed(ctx, bs) + 4
    k_cache, v_cache = make_caches(num_blocks, bs, kv_heads, head_dim, dtype, DEV, seed=11)
    meta = make_meta(ctx, q_lens, bs, num_blocks, DEV, seed=11)
    q, k, v = random_qkv(sum(q_lens), heads, kv_heads, head_dim, dtype, DEV, seed=12)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    backend = CudaAttentionBackend()
    out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, meta, head_dim ** -0.5)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    again = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)  # the cached plan is reused
    assert torch.equal(again, out)


# ---- end to end ---------------------------------------------------------------------------------------------------
def word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over ``t0 .. t{vocab_size-1}``: the engine needs one for detokenizing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")


@pytest.fixture(scope="module")
def smollm_shaped():
    """Random weights (N(0, 0.02) matrices, unit norms, untied head) so attention, not the token embedding,
    drives the next token."""
    from transformers import LlamaConfig

    from pagedserve.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model = model.to(DEV).eval().requires_grad_(False)
    model.reset_rotary_cache()
    return model, cfg, word_tokenizer(cfg.vocab_size)


def greedy(model, cfg, tokenizer, backend: str, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.engine.sampling_params import SamplingParams

    config = EngineConfig(device="cuda", dtype="float32", attention_backend=backend, num_kv_blocks=400,
                          max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8)
    engine, info = build_engine(config, model=model, tokenizer=tokenizer, hf_config=cfg)
    assert info.attention_backend == backend
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    return out


def test_greedy_generation_matches_torch_backend(smollm_shaped):
    """fp32, chunked prefill (256-token budget), more requests than max_num_seqs, a shared 64-token prefix."""
    model, cfg, tokenizer = smollm_shaped
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(n)] for n in (3, 17, 64, 129, 300, 77, 500, 9, 33)]
    prompts.append(prompts[4][:64] + prompts[1])
    cuda_out = greedy(model, cfg, tokenizer, "cuda", prompts, max_tokens=24)
    torch_out = greedy(model, cfg, tokenizer, "torch", prompts, max_tokens=24)
    assert all(len(t) == 24 for t in torch_out.values())
    assert len({tuple(t) for t in torch_out.values()}) > 1, "outputs should depend on the prompt"
    assert cuda_out == torch_out
