"""Each CUDA kernel against its torch reference (torch_ref.py, elementwise_ref.py) over a grid of shapes, dtypes,
head dims, block sizes and GQA ratios. Sized to run in about a minute on an H200 (NVRTC compiles included).
The checks themselves are in tests/kernel_cases.py; tests/kernel_tests/test_kernels_simt.py runs them on the host
emulator."""
from __future__ import annotations

import pytest
import torch

import kernel_cases as kc

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cupy")

DEV = torch.device("cuda")


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_decode_matches_reference(dtype, head_dim, block_size):
    kc.check_decode(DEV, dtype, head_dim, block_size, kc.GPU_DECODE_CASES, max_seqs_256=64)


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_decode_split_and_single_partition_agree(dtype):
    """Contexts of one and of several fixed 256-key partitions against the reference; each sequence alone and in a
    CUDA graph's wider fixed grid is the same bits as in the batch (batch invariance on the device)."""
    plan = kc.check_decode_partitions(DEV, dtype, [1, 63, 256, 257, 1500, 3001], 16, 2, 128, 16)
    assert plan.num_partitions == 12


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_prefill_matches_reference(dtype, head_dim, block_size):
    """Decodes, then prefill chunks after cached prefixes (kernel_cases.gpu_prefill_case)."""
    kc.check_prefill(DEV, dtype, head_dim, block_size, **kc.gpu_prefill_case(block_size))


@pytest.mark.parametrize("window", [1, 100, 4096])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_sliding_window_matches_reference(dtype, window):
    """Decode (with split-K) and prefill under a sliding window against the windowed torch reference."""
    kc.check_decode(DEV, dtype, 128, 16, kc.GPU_DECODE_CASES, window=window)
    kc.check_decode_partitions(DEV, dtype, [1, 63, 64, 65, 1500, 3001], 16, 2, 128, 16, window=window)
    kc.check_prefill(DEV, dtype, 128, 16, **kc.gpu_prefill_case(16), window=window)


@pytest.mark.parametrize("softcap,sinks", [(1.0, False), (None, True), (0.8, True)])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_softcap_and_sinks_match_reference(dtype, softcap, sinks):
    """Decode (with split-K) and prefill with Gemma 2's soft-cap and gpt-oss's sink logits against the reference."""
    kc.check_decode(DEV, dtype, 128, 16, kc.GPU_DECODE_CASES, softcap=softcap, sinks=sinks)
    kc.check_decode_partitions(DEV, dtype, [1, 33, 1500, 600], 8, 2, 128, 16, softcap=softcap, sinks=sinks)
    kc.check_prefill(DEV, dtype, 128, 16, **kc.gpu_prefill_case(16), softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_reshape_and_cache_is_exact(dtype):
    kc.check_reshape_and_cache(DEV, dtype)


def test_copy_blocks_is_exact():
    kc.check_copy_blocks(DEV)


@pytest.mark.parametrize("hidden", [576, 4096, 100])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_rms_norm(dtype, hidden):
    kc.check_rms_norm(DEV, dtype, hidden)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_rotary_embedding(dtype, head_dim, is_neox):
    kc.check_rotary(DEV, dtype, head_dim, is_neox)


@pytest.mark.parametrize("shape", [(37, 2 * 1536), (5, 2 * 7), (2, 3, 2 * 64)])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_silu_and_mul(dtype, shape):
    kc.check_silu_and_mul(DEV, dtype, shape)
