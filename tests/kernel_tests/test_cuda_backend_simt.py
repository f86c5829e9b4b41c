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
