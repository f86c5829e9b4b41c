"""Each CUDA kernel against its torch reference (attention/torch_ref.py, ops.py) over a grid of shapes, dtypes,
head dims, block sizes and GQA ratios. Sized to run in about a minute on an H200 (NVRTC compiles included).
The checks themselves are in tests/kernel_cases.py; tests/test_kernels_simt.py runs them on the host emulator."""
from __future__ import annotations

import random

import pytest
import torch

import kernel_cases as kc

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cupy")

DEV = torch.device("cuda")
# (context lengths, num_heads, num_kv_heads): batch 1..256, ragged contexts 1..16k, GQA ratios 1, 3, 4, 8, 16.
DECODE_CASES = [
    ([1], 8, 8),
    ([random.Random(1).randint(1, 300) for _ in range(256)], 32, 4),
    ([1, 17, 513, 4097, 16384], 16, 4),
    ([random.Random(2).randint(1, 2048) for _ in range(64)], 8, 1),
    ([77, 1000, 3], 9, 3),
    ([5000, 31], 32, 2),
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_decode_matches_reference(dtype, head_dim, block_size):
    kc.check_decode(DEV, dtype, head_dim, block_size, DECODE_CASES, max_seqs_256=64)


@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_decode_split_and_single_partition_agree(dtype):
    """The same batch through a forced 64-token split-K plan, the automatic plan and one partition."""
    auto = kc.check_decode_partitions(DEV, dtype, [1, 63, 64, 65, 1500, 3001], 16, 2, 128, 16, (64, None, 3008))
    assert auto.num_partitions > 1


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_prefill_matches_reference(dtype, head_dim, block_size):
    """Prefill chunks after cached prefixes: block-aligned, unaligned, long (15000), none (1000 new tokens), and a
    one-token chunk that is not a decode (it follows prefills)."""
    kc.check_prefill(DEV, dtype, head_dim, block_size, prefix=[2 * block_size, 333, 15000, 5, 90, 0, 40],
                     new=[200, 5, 130, 64, 63, 1000, 1])


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
