"""The quantized linears' fused path (1-4 tokens: decode steps) on AVX-512 (kernels/csrc/linear_fused512.hpp) and on
AVX2, each against the float64 product with the dequantized weight, within float32 accumulation error, and the two
against each other. ``pagedserve_cpu::linear_avx512(mode)`` switches the path (restored after each test); the
AVX-512 cases are skipped on CPUs without AVX-512F/BW/DQ/VL."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_build import cpu_kernel_ops, unavailable_reason
from pagedserve.models.cpu_linear import StreamingInt4Linear, StreamingInt8Linear
from pagedserve.models.quant import Int8BlockWeight, quantize_int4, quantize_int8_per_channel
from support import kernel_switch

pytestmark = pytest.mark.skipif(cpu_kernel_ops() is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    yield from kernel_switch(torch.ops.pagedserve_cpu.linear_avx512, request.param == "avx512", "AVX-512")


def _check(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = F.linear(x.double(), dense.double(), None if bias is None else bias.double())
    bound = 4 * x.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ dense.abs().double().t()) + 1e-5
    assert ((got.double() - ref).abs() <= bound + 1e-6 * ref.abs()).all()


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_fused_q4_matches_float64(m, group, isa):
    gen = torch.Generator().manual_seed(m * group)
    q = quantize_int4(torch.randn(97, 384, generator=gen), group)
    bias = torch.randn(97, generator=gen)
    x = torch.randn(m, 384, generator=gen)
    _check(StreamingInt4Linear(q, bias)(x), x, q.dequantize(), bias)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fused_q8_matches_float64(m, isa):
    gen = torch.Generator().manual_seed(200 + m)
    codes = torch.randint(-128, 128, (51, 160), dtype=torch.int8, generator=gen)
    for weight in (Int8BlockWeight(codes, (torch.rand(51, 5, generator=gen) / 50).half()),
                   quantize_int8_per_channel(torch.randn(51, 160, generator=gen))):
        x = torch.randn(m, 160, generator=gen)
        _check(StreamingInt8Linear(weight)(x), x, weight.dequantize(), None)


def test_avx512_switch_rejects_bad_mode():
    with pytest.raises(RuntimeError, match="mode must be"):
        torch.ops.pagedserve_cpu.linear_avx512(2)
