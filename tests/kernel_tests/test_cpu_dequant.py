"""The float32 GEMM path of the quantized linears (kernels/csrc/dequant.cpp, models/cpu_linear.py's ``dq_min_tokens``):

- ``dequantize_q4`` computes ``q * scale + min`` with one FMA per weight, so each element is the float64 value of
  that expression rounded once to float32: compared bit for bit (nibble order, groups of 32/64/128, row tails over
  the threads' row split);
- ``dequantize_q8``: ``q * scale`` rounded once, likewise bit for bit (Q8_0 blocks, int8 per channel, code -128);
- the layers: from ``dq_min_tokens`` tokens the output is exactly ``F.linear(x, layer.dequantize(), bias)`` and
  within float32 accumulation error of the float-activation kernel; below it the other paths run unchanged.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_build import cpu_kernel_ops, unavailable_reason
from pagedserve.models.cpu_linear import (DQ_MAX_WEIGHTS, DQ_MIN_TOKENS, StreamingInt4Linear, StreamingInt8Linear,
                                          use_dequantized_gemm, use_int8_activations)
from pagedserve.models.quant import Int8BlockWeight, quantize_int4, quantize_int8_per_channel

pytestmark = pytest.mark.skipif(cpu_kernel_ops() is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")
ops = torch.ops.pagedserve_cpu


def _q4_layer(n: int, k: int, group: int, seed: int) -> StreamingInt4Linear:
    gen = torch.Generator().manual_seed(seed)
    return StreamingInt4Linear(quantize_int4(torch.randn(n, k, generator=gen) * 3, group),
                               torch.randn(n, generator=gen))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_q4_is_one_rounding_of_q_scale_plus_min(group):
    layer = _q4_layer(37, 256, group, group)   # 37 rows: a tail past the 16-row work items
    runs = layer.codes.view(37, 256 // 32, 16)   # 16 bytes per 32 weights: low nibbles first, then high
    codes = torch.stack([runs & 0x0F, runs >> 4], -2).flatten(1)
    exact = (codes.double() * layer.scales.double().repeat_interleave(group, 1)
             + layer.mins.double().repeat_interleave(group, 1)).float()
    got = layer.dequantize()
    assert got.dtype == torch.float32 and got.shape == (37, 256)
    assert torch.equal(got, exact)


def test_dequantize_q8_is_one_rounding_of_q_scale():
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (21, 96), dtype=torch.int8, generator=gen)
    codes[0, :5] = -128
    for weight in (Int8BlockWeight(codes, (torch.rand(21, 3, generator=gen) / 50).half()),
                   quantize_int8_per_channel(torch.randn(21, 96, generator=gen))):
        layer = StreamingInt8Linear(weight)
        exact = (layer.codes.double().view(21, -1, layer.group_size)
                 * layer.scales.double().unsqueeze(-1)).view(21, 96).float()
        assert torch.equal(layer.dequantize(), exact)
        assert torch.equal(layer.dequantize(), weight.dequantize())


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_layers_take_the_gemm_from_dq_min_tokens(kind):
    gen = torch.Generator().manual_seed(11)
    layer = _q4_layer(40, 96, 32, 5) if kind == "q4" else \
        StreamingInt8Linear(quantize_int8_per_channel(torch.randn(40, 96, generator=gen)), torch.randn(40))
    float_path = (lambda x: ops.linear_q4(x, layer.codes, layer.scales, layer.mins, 32, layer.bias)) if kind == "q4" \
        else (lambda x: ops.linear_q8(x, layer.codes, layer.scales, layer.group_size, layer.bias))
    assert layer.dq_min_tokens == 0
    assert use_dequantized_gemm(torch.nn.Sequential(layer), 8) == 1 and layer.dq_min_tokens == 8
    use_int8_activations(torch.nn.Sequential(layer), 4, 1)   # the int8 path below 8 tokens
    small, big = torch.randn(7, 96, generator=gen), torch.randn(2, 4, 96, generator=gen)
    flat = big.reshape(8, 96)
    got = layer(big)
    assert got.shape == (2, 4, 40)
    assert torch.equal(got.reshape(8, 40), F.linear(flat, layer.dequantize(), layer.bias))
    assert torch.allclose(got.reshape(8, 40), float_path(flat), rtol=1e-5, atol=1e-4)
    a8 = ops.linear_q4_a8(small, layer.codes, layer.scales, layer.mins, 32, layer.bias, 1) if kind == "q4" else \
        ops.linear_q8_a8(small, layer.codes, layer.scales, layer.group_size, layer.bias, 1)
    assert torch.equal(layer(small), a8)
    assert layer(big.bfloat16()).dtype == torch.bfloat16
    use_dequantized_gemm(torch.nn.Sequential(layer), 0)
    use_int8_activations(torch.nn.Sequential(layer), 0)
    assert torch.equal(layer(flat), float_path(flat))


def test_large_layers_keep_the_own_kernels_and_errors():
    n = DQ_MAX_WEIGHTS // 64 + 16   # K = 64: one more 16-row group than the limit allows
    head = StreamingInt8Linear(quantize_int8_per_channel(torch.randn(n, 64)))
    small = _q4_layer(16, 64, 32, 1)
    assert use_dequantized_gemm(torch.nn.Sequential(head, small)) == 1
    assert (head.dq_min_tokens, small.dq_min_tokens) == (0, DQ_MIN_TOKENS)
    with pytest.raises(ValueError, match="min_tokens"):
        use_dequantized_gemm(torch.nn.Sequential(), -1)
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 32"):
        ops.dequantize_q4(small.codes, small.scales, small.mins, 48)
    with pytest.raises(RuntimeError, match="scale must be"):
        ops.dequantize_q4(small.codes, small.scales[:, :1].contiguous(), small.mins, 32)
    with pytest.raises(RuntimeError, match="codes must be contiguous int8"):
        ops.dequantize_q8(small.codes, small.scales, 32)
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 8"):
        ops.dequantize_q8(head.codes, head.scales, 0)
