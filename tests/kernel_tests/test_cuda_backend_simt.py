"""The CUDA attention backend (and the fused elementwise kernels that run with it) on the host emulator against the
torch backend, on CPU: one mixed step per dtype, and greedy generation through LLMEngine on a small random-weight
Llama (chunked prefill, prefix-cache hit, more requests than max_num_seqs). The GPU version of the same checks is
tests/kernel_tests/gpu/test_cuda_backend_gpu.py."""
from __future__ import annotations

import pytest
import torch

import backend_cases as bc
from pagedserve.attention.cuda import CudaAttentionBackend
from simt import Simulator, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(scope="module")
def sim():
    with Simulator().install() as s:
        yield s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_mixed_step_matches_torch_backend(sim, dtype):
    bc.check_mixed_step(torch.device("cpu"), dtype, CudaAttentionBackend())


def test_layers_of_two_windows_share_a_step(sim):
    """Full-attention and sliding-window layers alternate in one step (Qwen2 / Gemma style): each gets the plan of
    its window (the backend keeps one per window and step), and each equals the torch backend."""
    bc.check_mixed_step(torch.device("cpu"), torch.float16, CudaAttentionBackend(), (None, 48, None, 7, 48))


def test_greedy_generation_matches_torch_backend(sim):
    """2 layers of SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64), a 64-token prefill budget."""
    shape = dict(bc.SMOLLM_SHAPE, num_hidden_layers=2, vocab_size=2048, intermediate_size=384, hidden_size=576)
    model, cfg, tokenizer = bc.random_llama(torch.device("cpu"), **shape)
    bc.check_greedy_backends_agree(model, cfg, tokenizer, "cpu", (3, 17, 64, 129, 90, 77, 40, 9, 33), max_tokens=8,
                                   max_num_batched_tokens=64, cuda_backend=CudaAttentionBackend())
    launched = {name.split("<")[0] for name, *_ in sim.launches}
    assert {"reshape_and_cache_kernel", "paged_decode_kernel", "paged_prefill_fp32_kernel", "rms_norm_kernel",
            "rotary_embedding_kernel", "silu_and_mul_kernel"} <= launched


def test_copy_blocks_matches_index_copy(sim):
    bc.check_backend_copy_blocks(torch.device("cpu"), CudaAttentionBackend())
    assert any(name.startswith("copy_blocks_kernel") for name, *_ in sim.launches)


def test_beam_search_copy_on_write_matches_torch_backend(sim):
    """Beam search whose forks share partial blocks: the copies go through the copy_blocks kernel."""
    model, cfg, tokenizer = bc.random_llama(torch.device("cpu"), num_hidden_layers=2, vocab_size=256,
                                            hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=64)
    before = sum(1 for name, *_ in sim.launches if name.startswith("copy_blocks_kernel"))
    bc.check_beam_backends_agree(model, cfg, tokenizer, "cpu", cuda_backend=CudaAttentionBackend())
    assert sum(1 for name, *_ in sim.launches if name.startswith("copy_blocks_kernel")) > before


@pytest.mark.parametrize("label", ["gemma2", "gpt-oss"])
def test_softcap_and_sink_families_match_transformers(sim, tmp_path, label):
    """Gemma 2 (soft-capped scores, alternating windows, KV layer groups) and gpt-oss (attention sinks, experts)
    through the engine on the emulated CUDA backend: greedy tokens equal transformers' (head_dim 64, three prompts,
    64-token chunks: the fp32 prefill kernel and the decode kernel both run the layers' options)."""
    import random

    from backend_cases import word_tokenizer
    from family_cases import engine_greedy, hf_config, hf_greedy, save_random_checkpoint
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    hf = save_random_checkpoint(hf_config(label, head_dim=64), tmp_path)
    src = ModelSource.resolve(str(tmp_path))
    cfg = src.load_config()
    model = build_model(src, cfg, torch.float32, "cpu")
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64,
                          max_num_seqs=4, enforce_eager=True)
    engine, _ = build_engine(config, model=model, tokenizer=word_tokenizer(256), hf_config=cfg,
                             backend=CudaAttentionBackend())
    rng = random.Random(8)
    prompts = [rng.choices(range(2, 256), k=n) for n in (7, 45, 130)]
    out = engine_greedy(engine, prompts, 4)
    assert out == {f"r{i}": hf_greedy(hf, ids, 4) for i, ids in enumerate(prompts)}
    launched = {name.split("<")[0] for name, *_ in sim.launches}
    assert {"paged_decode_kernel", "paged_prefill_fp32_kernel"} <= launched
    if label == "gpt-oss":   # the experts' routing and weighted sum on cuda/moe.cu
        assert {"moe_topk_kernel", "moe_combine_kernel"} <= launched
