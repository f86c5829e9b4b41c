"""The int4 linear at decode on AVX-512 VNNI (kernels/csrc/linear_vnni.cpp, ``pack_q4_vnni`` + ``linear_q4_vnni``)
against ``linear_q4_a8``, whose function it computes on a repacked copy of the weight: bit for bit, one level and two
(the same integer sums, the two digits' sums combined the same way, the same float operations per block in the same
order). Shapes: every
token count of one register tile and past it, N not a multiple of the 16-row panel, Q4 groups of 32/64/128, with and
without bias, a block of zeros (scale 0). The int8 layers' ``linear_q8_vnni`` (``pack_q8_vnni``: codes biased to
unsigned, the bias taken back in int32) against ``linear_q8_a8`` the same way: Q8_0 blocks with codes -128..127
and int8 per channel. ``linear_q4_a8`` / ``linear_q8_a8`` are checked against torch in test_cpu_linear_a8.py.
Skipped where the CPU lacks AVX-512 VNNI."""
from __future__ import annotations

import pytest
import torch

from pagedserve.models.cpu_linear import (VNNI_MAX_TOKENS, StreamingInt4Linear, StreamingInt8Linear, linear_path_of,
                                          use_int8_activations, use_vnni, vnni_available)
from pagedserve.models.quant import Int8BlockWeight, quantize_int4, quantize_int8_per_channel

pytestmark = pytest.mark.skipif(not vnni_available(), reason="AVX-512 VNNI not available here (CPU or kernels)")
ops = torch.ops.pagedserve_cpu


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 11, 40])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_vnni_equals_the_int8_activation_kernel(m, group):
    gen = torch.Generator().manual_seed(m + group)
    layer = StreamingInt4Linear(quantize_int4(torch.randn(61, 384, generator=gen), group),
                                torch.randn(61, generator=gen))
    packed = ops.pack_q4_vnni(layer.codes, layer.scales, layer.mins, group)
    assert packed[0].shape == (4, 384 // 32 * 256) and packed[1].shape == packed[2].shape == (4, 384 // 32 * 16)
    x = torch.randn(m, 384, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, 32:64] = 0.0                                      # a block of zeros: scale 0
    for bias in (layer.bias, None):
        args = (x, layer.codes, layer.scales, layer.mins, group, bias)
        assert torch.equal(ops.linear_q4_vnni(x, *packed, 61, bias, 1), ops.linear_q4_a8(*args, 1))
        two = ops.linear_q4_vnni(x, *packed, 61, bias, 2)
        assert torch.equal(two, ops.linear_q4_a8(*args, 2))
        exact = x.double() @ layer.dequantize().double().T + (0 if bias is None else bias.double())
        assert (two.double() - exact).abs().max().item() < 1e-3 * exact.abs().max().item()


def test_layer_takes_vnni_up_to_vnni_max_tokens():
    gen = torch.Generator().manual_seed(1)
    layer = StreamingInt4Linear(quantize_int4(torch.randn(40, 96, generator=gen), 32))
    assert layer.vnni_max_tokens == 0 and layer.vnni_panels is None
    assert use_vnni(torch.nn.Sequential(layer), 6) == 1 and layer.vnni_max_tokens == 6
    layer.a8_levels = 1
    small, big = torch.randn(2, 3, 96, generator=gen), torch.randn(7, 96, generator=gen)
    args = (layer.codes, layer.scales, layer.mins, 32, None)
    assert torch.equal(layer(small).reshape(6, 40), ops.linear_q4_a8(small.reshape(6, 96), *args, 1))
    assert torch.equal(layer(big), ops.linear_q4(big, *args))
    use_vnni(torch.nn.Sequential(layer), 0)
    assert layer.vnni_panels is None
    assert torch.equal(layer(small).reshape(6, 40), ops.linear_q4(small.reshape(6, 96), *args))
    assert VNNI_MAX_TOKENS >= 1


def test_vnni_rejects_bad_arguments():
    layer = StreamingInt4Linear(quantize_int4(torch.randn(16, 64), 32))
    packed = ops.pack_q4_vnni(layer.codes, layer.scales, layer.mins, 32)
    with pytest.raises(RuntimeError, match="levels must be 1 or 2"):
        ops.linear_q4_vnni(torch.randn(2, 64), *packed, 16, None, 3)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.linear_q4_vnni(torch.randn(2, 96), *packed, 16, None, 1)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.linear_q4_vnni(torch.randn(2, 64), *packed, 17 + 16, None, 1)
    with pytest.raises(RuntimeError, match="scale must be"):
        ops.pack_q4_vnni(layer.codes, layer.scales[:8], layer.mins, 32)
    with pytest.raises(ValueError, match="max_tokens"):
        use_vnni(torch.nn.Sequential(), -1)


@pytest.mark.parametrize("m", [1, 2, 4, 5, 11, 40])
@pytest.mark.parametrize("levels", [1, 2])
def test_q8_vnni_equals_the_int8_activation_kernel(m, levels):
    gen = torch.Generator().manual_seed(m + 10 * levels)
    codes = torch.randint(-128, 128, (61, 160), generator=gen, dtype=torch.int8)   # -128 too: Q8_0 allows it
    blocks = StreamingInt8Linear(Int8BlockWeight(codes, (torch.rand(61, 5, generator=gen) / 50).half()),
                                 torch.randn(61, generator=gen))
    channel = StreamingInt8Linear(quantize_int8_per_channel(torch.randn(61, 160, generator=gen)))
    x = torch.randn(m, 160, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, 32:64] = 0.0                                      # a block of zeros: scale 0
    for layer in (blocks, channel):
        packed, dw = ops.pack_q8_vnni(layer.codes, layer.scales, layer.group_size)
        assert packed.shape == (4, 160 // 32 * 512) and dw.shape == (4, 160 // 32 * 16)
        for bias in (layer.bias, None):
            want = ops.linear_q8_a8(x, layer.codes, layer.scales, layer.group_size, bias, levels)
            assert torch.equal(ops.linear_q8_vnni(x, packed, dw, 61, bias, levels), want)


def test_int8_layer_takes_vnni_and_keeps_its_bits():
    gen = torch.Generator().manual_seed(3)
    layer = StreamingInt8Linear(quantize_int8_per_channel(torch.randn(40, 96, generator=gen)))
    model = torch.nn.Sequential(layer)
    use_int8_activations(model, 1, 2)
    x = torch.randn(7, 96, generator=gen)
    before = layer(x)
    assert "int8: avx512-vnni" not in linear_path_of(model)
    assert use_vnni(model, VNNI_MAX_TOKENS) == 1 and layer.q8_vnni_panels is not None and layer.a8_panels is None
    assert torch.equal(layer(x), before)                   # linear_a8_packed before, linear_q8_vnni now
    assert "int8: avx512-vnni panels" in linear_path_of(model)
    assert not hasattr(layer, "vnni_panels")               # the fused decode stack takes int4 layers only
    use_vnni(model, 0)
    assert layer.q8_vnni_panels is None


def test_q8_vnni_rejects_bad_arguments():
    codes = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    packed, dw = ops.pack_q8_vnni(codes, torch.rand(16, 2), 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.linear_q8_vnni(torch.randn(2, 96), packed, dw, 16, None, 1)
    with pytest.raises(RuntimeError, match="levels must be 1 or 2"):
        ops.linear_q8_vnni(torch.randn(2, 64), packed, dw, 16, None, 0)
    with pytest.raises(RuntimeError, match="codes must be"):
        ops.pack_q8_vnni(codes.to(torch.uint8), torch.rand(16, 2), 32)
    with pytest.raises(RuntimeError, match="scale must be"):
        ops.pack_q8_vnni(codes, torch.rand(16, 3), 32)
