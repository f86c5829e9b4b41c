"""The int4 linear on AMX tiles (kernels/csrc/linear_amx.cpp, ``linear_q4_amx``) against ``linear_q4_a8``, whose
function it computes: the same per-token int8 quantization of the activations in blocks of 32 and exact integer
sums and the same float operations in the same order per block (level 0, level 1, min term), so one level and two
are bit for bit ``linear_q4_a8``'s output (and so ``linear_q4_vnni``'s: the batch invariance of the int4 layers rests
on it, and the engine checks it at load before AMX takes a call). ``linear_q4_a8`` itself is
checked against torch in test_cpu_linear_a8.py. Shapes: M past one 16-token group and past the 256-token block with
a tail, N not a multiple of the 16-row panel, Q4 groups of 32/64/128, with and without bias. Skipped where the CPU
or the OS does not provide AMX-INT8."""
from __future__ import annotations

import pytest
import torch

from pagedserve.models.cpu_linear import AMX_MIN_TOKENS, StreamingInt4Linear, amx_available, use_amx
from pagedserve.models.quant import quantize_int4

pytestmark = pytest.mark.skipif(not amx_available(), reason="AMX-INT8 not available here (CPU, OS or kernels)")
ops = torch.ops.pagedserve_cpu


@pytest.mark.parametrize("m", [1, 17, 300])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_amx_equals_the_int8_activation_kernel(m, group):
    gen = torch.Generator().manual_seed(m + group)
    layer = StreamingInt4Linear(quantize_int4(torch.randn(61, 384, generator=gen), group),
                                torch.randn(61, generator=gen))
    x = torch.randn(m, 384, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, 32:64] = 0.0                                      # a block of zeros: scale 0
    for bias in (layer.bias, None):
        args = (x, layer.codes, layer.scales, layer.mins, group, bias)
        assert torch.equal(ops.linear_q4_amx(*args, 1), ops.linear_q4_a8(*args, 1))
        assert torch.equal(ops.linear_q4_amx(*args, 2), ops.linear_q4_a8(*args, 2))


def test_layer_takes_amx_from_amx_min_tokens():
    gen = torch.Generator().manual_seed(1)
    layer = StreamingInt4Linear(quantize_int4(torch.randn(40, 96, generator=gen), 32))
    assert layer.amx_min_tokens == 0
    assert use_amx(torch.nn.Sequential(layer), 8) == 1 and layer.amx_min_tokens == 8
    layer.a8_levels = 1
    small, big = torch.randn(7, 96, generator=gen), torch.randn(2, 4, 96, generator=gen)
    args = (layer.codes, layer.scales, layer.mins, 32, None)
    assert torch.equal(layer(big).reshape(8, 40), ops.linear_q4_amx(big.reshape(8, 96), *args, 1))
    assert torch.equal(layer(small), ops.linear_q4(small, *args))
    use_amx(torch.nn.Sequential(layer), 0)
    assert torch.equal(layer(big).reshape(8, 40), ops.linear_q4(big.reshape(8, 96), *args))
    assert AMX_MIN_TOKENS >= 1


def test_amx_rejects_bad_arguments():
    layer = StreamingInt4Linear(quantize_int4(torch.randn(16, 64), 32))
    args = (layer.codes, layer.scales, layer.mins, 32, None)
    with pytest.raises(RuntimeError, match="levels must be 1 or 2"):
        ops.linear_q4_amx(torch.randn(2, 64), *args, 3)
    with pytest.raises(RuntimeError, match="x has K"):
        ops.linear_q4_amx(torch.randn(2, 32), *args, 1)
    with pytest.raises(ValueError, match="min_tokens"):
        use_amx(torch.nn.Sequential(), -1)
