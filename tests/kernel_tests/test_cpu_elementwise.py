"""The C++ elementwise layers (kernels/cpu_elementwise.py, csrc/elementwise.cpp) against their torch references:
RMSNorm with and without the fused residual add, rotary embedding (neox halves and interleaved pairs, on strided
views of a fused QKV output), SwiGLU including exp's range ends; the fallbacks; the argument checks; and that the
CPU attention backend carries them."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import elementwise_ref as ops
from pagedserve.attention.cpu import CpuAttentionBackend, cpu_decode_kernel_available
from pagedserve.kernels import cpu_elementwise as ew

pytestmark = pytest.mark.skipif(not cpu_decode_kernel_available(), reason="CPU kernels unavailable")

TOKENS = [1, 3, 64, 300]   # 300 x 576 floats crosses the threshold where rows are split over threads


@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_reference(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = torch.randn(tokens, 576, generator=gen), torch.randn(tokens, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    normed, h = ew.rms_norm(x, weight, 1e-5, residual)
    ref_normed, ref_h = ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(h, ref_h)                                   # the residual sum is one float add per element
    torch.testing.assert_close(normed, ref_normed, rtol=1e-6, atol=2e-6)
    normed, h = ew.rms_norm(x, weight, 1e-5)
    assert h is x                                                  # as the reference: no residual, h is x
    torch.testing.assert_close(normed, ops.rms_norm(x, weight, 1e-5)[0], rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_matches_reference_on_qkv_views(tokens, is_neox):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 960, generator=gen)                  # 9 query heads, 3 KV heads of 64
    q, k = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
    table = ops.rotary_cos_sin_cache(64, 2048, 10000.0)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    for x in (q, k):
        got = ew.rotary_embedding(positions, x, table, is_neox)
        assert got.is_contiguous() and got.shape == x.shape
        torch.testing.assert_close(got, ops.rotary_embedding(positions, x, table, is_neox), rtol=0, atol=1e-6)


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_matches_reference(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 3072, generator=gen) * 6
    torch.testing.assert_close(ew.silu_and_mul(x), ops.silu_and_mul(x), rtol=1e-6, atol=1e-6)


def test_silu_at_exp_range_ends():
    gate = torch.tensor([-1e4, -100., -88., -87., -20., -1e-3, 0., 1e-3, 20., 87., 88., 89., 100., 1e4,
                         float("inf"), 3.])
    x = torch.cat([gate, torch.full_like(gate, 1.5)]).unsqueeze(0)
    torch.testing.assert_close(ew.silu_and_mul(x), ops.silu_and_mul(x), rtol=1e-6, atol=1e-30)


def test_other_dtypes_and_shapes_fall_back_to_reference():
    x = torch.randn(2, 24, dtype=torch.bfloat16)    # bf16: the reference runs
    assert torch.equal(ew.silu_and_mul(x), ops.silu_and_mul(x))
    y = torch.randn(2, 12)                          # width not a multiple of 8
    assert torch.equal(ew.rms_norm(y, torch.ones(12), 1e-6)[0], ops.rms_norm(y, torch.ones(12), 1e-6)[0])


def test_kernels_reject_bad_arguments():
    table = ops.rotary_cos_sin_cache(64, 16, 10000.0)
    with pytest.raises(RuntimeError, match="position 99 out of range"):
        ew.rotary_embedding(torch.tensor([99]), torch.randn(1, 2, 64), table)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        torch.ops.pagedserve_cpu.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="weight must be contiguous float32"):
        torch.ops.pagedserve_cpu.rms_norm(torch.randn(2, 8), torch.ones(16), 1e-6, None)


def test_cpu_backend_carries_the_cpu_elementwise_set():
    assert CpuAttentionBackend.elementwise is ew.CPU_OPS and ew.CPU_OPS.traceable
