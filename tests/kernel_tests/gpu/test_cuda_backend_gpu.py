"""The CUDA attention backend against the torch backend on a GPU: one mixed step (cache writes and outputs), and
greedy generation through LLMEngine on a random-weight Llama of SmolLM2-135M's shape. The checks are in
tests/backend_cases.py; tests/kernel_tests/test_cuda_backend_simt.py runs them on the host emulator at a smaller size."""
from __future__ import annotations

import pytest
import torch

import backend_cases as bc
from pagedserve.attention import select_attention_backend

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
    bc.check_mixed_step(DEV, dtype, CudaAttentionBackend(), (None, 48, None, 7))  # full and windowed layers


@pytest.fixture(scope="module")
def smollm_shaped():
    return bc.random_llama(DEV, **bc.SMOLLM_SHAPE)


def test_greedy_generation_matches_torch_backend(smollm_shaped):
    """fp32, chunked prefill (256-token budget), more requests than max_num_seqs, a shared 64-token prefix; the
    cuda backend also runs the fused RMSNorm / rotary / SiLU-and-mul kernels."""
    bc.check_greedy_backends_agree(*smollm_shaped, "cuda", (3, 17, 64, 129, 300, 77, 500, 9, 33), max_tokens=24)


def test_copy_blocks_matches_index_copy():
    bc.check_backend_copy_blocks(DEV, CudaAttentionBackend())


def test_beam_search_copy_on_write_matches_torch_backend(smollm_shaped):
    """Beam search (widths 2 and 3, short prompts): the copy-on-write copies run the copy_blocks kernel."""
    bc.check_beam_backends_agree(*smollm_shaped, "cuda")
