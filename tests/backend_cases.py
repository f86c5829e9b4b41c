"""The CUDA attention backend against the torch backend, shared by the GPU tests
(tests/kernel_tests/gpu/test_cuda_backend_gpu.py) and the host-emulator tests (tests/kernel_tests/test_cuda_backend_simt.py):
one mixed step, and greedy generation through :class:`pagedserve.engine.llm_engine.LLMEngine` on a random-weight
Llama, and beam search with copy-on-write KV blocks (the backend's ``copy_blocks``). Also the random-weight Llama
builder (:func:`random_llama`, :data:`TINY_LLAMA`) behind conftest's shared ``random_llama_model`` / ``tiny_llama``."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.torch_ref import TorchAttentionBackend
from paged_batch import ATTN_TOL, blocks_needed, make_caches, make_meta, random_qkv

# SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, ffn 1536, vocab 49152).
SMOLLM_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def check_mixed_step(device, dtype, backend, windows=(None,)):
    """Decodes first, then prefill chunks; ``backend`` and the torch backend write the same cache rows and return
    the same output, and a second call (reusing the backend's cached plan) returns it again. ``windows``: the
    layers of the step in turn, each a sliding window or None (the same metadata, as a step's layers share it)."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    ctx = [40, 1, 700, 17, 300, 2000]
    q_lens = [1, 1, 1, 17, 45, 512]
    num_blocks = blocks_needed(ctx, bs) + 4
    k_cache, v_cache = make_caches(num_blocks, bs, kv_heads, head_dim, dtype, device, seed=11)
    meta = make_meta(ctx, q_lens, bs, num_blocks, device, seed=11)
    q, k, v = random_qkv(sum(q_lens), heads, kv_heads, head_dim, dtype, device, seed=12)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    reference = TorchAttentionBackend()
    atol, rtol = ATTN_TOL[dtype]
    for window in windows:
        out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5, window)
        ref = reference.forward(q, k, v, kc_ref, vc_ref, meta, head_dim ** -0.5, window)
        assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
        again = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5, window)
        assert torch.equal(again, out)


def word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over ``t0 .. t{vocab_size-1}``: the engine needs one for detokenizing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")


#: The tiny Llama most engine tests run on (conftest's ``tiny_llama``): 2 layers, hidden 64, 4 query / 2 KV heads of
#: 16, ffn 128, vocab 256.
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)


def random_llama(device, **shape):
    """A Llama of ``shape`` (SMOLLM_SHAPE keys) with random weights: N(0, 0.02) matrices, unit norms, untied head,
    so attention, not the token embedding, drives the next token. Returns (model, config, tokenizer)."""
    from transformers import LlamaConfig

    from pagedserve.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model = model.to(device).eval().requires_grad_(False)
    model.reset_rotary_cache()
    return model, cfg, word_tokenizer(cfg.vocab_size)


def greedy(model, cfg, tokenizer, device: str, backend: str, prompts: list[list[int]], max_tokens: int,
           max_num_batched_tokens: int = 256, backend_impl=None) -> dict[str, list[int]]:
    """Greedy outputs of an engine with attention backend ``backend`` (fp32, chunked prefill, 8 running);
    ``backend_impl`` is the backend object to use (default: the one ``--attention-backend backend`` selects)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.sampling_params import SamplingParams

    config = EngineConfig(device=device, dtype="float32", attention_backend=backend, num_kv_blocks=400,
                          max_model_len=1024, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8)
    engine, info = build_engine(config, model=model, tokenizer=tokenizer, hf_config=cfg, backend=backend_impl)
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


def check_greedy_backends_agree(model, cfg, tokenizer, device: str, lengths, max_tokens: int,
                                max_num_batched_tokens: int = 256, cuda_backend=None):
    """More prompts than max_num_seqs (8), one sharing a 64-token prefix with another (prefix-cache hit); the
    cuda backend's greedy tokens equal the torch backend's. ``cuda_backend``: the backend object for the cuda
    run (the emulated one on CPU); default: what ``--attention-backend cuda`` selects."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(n)] for n in lengths]
    prompts.append(prompts[4][:64] + prompts[1])
    cuda_out = greedy(model, cfg, tokenizer, device, "cuda", prompts, max_tokens, max_num_batched_tokens,
                      cuda_backend)
    torch_out = greedy(model, cfg, tokenizer, device, "torch", prompts, max_tokens, max_num_batched_tokens)
    assert all(len(t) == max_tokens for t in torch_out.values())
    assert len({tuple(t) for t in torch_out.values()}) > 1, "outputs should depend on the prompt"
    assert cuda_out == torch_out


def check_backend_copy_blocks(device, backend, dtype=torch.float32):
    """``backend.copy_blocks`` (copy-on-write) equals the reference index copy of the base class: 3 layers,
    two copies in one call, other blocks untouched."""
    from pagedserve.attention.torch_ref import TorchAttentionBackend

    gen = torch.Generator().manual_seed(3)
    caches = [tuple(torch.randn(12, 8, 2, 64, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
              for _ in range(3)]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    copies = [(4, 9), (0, 5)]
    TorchAttentionBackend().copy_blocks(expected, copies)
    backend.copy_blocks(caches, copies)
    assert all(torch.equal(a, b) for (k, v), (ek, ev) in zip(caches, expected) for a, b in ((k, ek), (v, ev)))
    assert torch.equal(expected[1][0][9], expected[1][0][4]) and not torch.equal(expected[1][0][9],
                                                                                caches[1][0][8])


def beam_outputs(model, cfg, tokenizer, device: str, backend: str, prompts: list[list[int]], backend_impl=None,
                 max_tokens: int = 6) -> tuple[dict, int]:
    """Beam search (widths 2 and 3; short prompts, so forks share partial blocks) through LLMEngine; returns
    ({request_id: [(token_ids, cumulative_logprob), ...]}, number of copy-on-write block copies made)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.sampling_params import SamplingParams

    config = EngineConfig(device=device, dtype="float32", attention_backend=backend, num_kv_blocks=128,
                          block_size=16, max_model_len=256, max_num_seqs=8)
    engine, _ = build_engine(config, model=model, tokenizer=tokenizer, hf_config=cfg, backend=backend_impl)
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=2,
                                beam_search={"beam_width": 2 + i % 2})
        engine.add_request(f"r{i}", ids, params)
    out: dict = {}
    num_copies = 0
    take = engine.kv_cache.take_block_copies

    def counting_take():
        nonlocal num_copies
        copies = take()
        num_copies += len(copies)
        return copies

    engine.kv_cache.take_block_copies = counting_take
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).append((d.token_ids, d.cumulative_logprob))
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return out, num_copies


def check_beam_backends_agree(model, cfg, tokenizer, device: str, cuda_backend=None):
    """Beam search with the cuda backend (its copy_blocks kernel doing the copy-on-write) returns the torch
    backend's sequences, logprobs within 1e-4; copies did happen."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(n)] for n in (5, 10, 7)]
    cuda_out, cuda_copies = beam_outputs(model, cfg, tokenizer, device, "cuda", prompts, cuda_backend)
    torch_out, torch_copies = beam_outputs(model, cfg, tokenizer, device, "torch", prompts)
    assert cuda_copies > 0 and cuda_copies == torch_copies
    assert [[t for t, _ in v] for v in cuda_out.values()] == [[t for t, _ in v] for v in torch_out.values()]
    for rid, v in torch_out.items():
        assert [c for _, c in cuda_out[rid]] == pytest.approx([c for _, c in v], abs=1e-4)
