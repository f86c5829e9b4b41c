"""The int8-activation linears (kernels/csrc/linear_a8.*, ``linear_q4_a8`` / ``linear_q8_a8``) against torch:

- the oracle is torch's float32/float64 matmul with the dequantized weight. Quantizing an activation block of 32 to
  int8 with ``d = max|x| / 127`` moves each element by at most ``d / 2``, so ``|y - x @ W.T|`` is at most
  ``sum_b d[t, b] / 2 * sum_(k in b) |W[n, k]|`` (the stated tolerance; times 1 + 1e-4 for the float32 rounding of
  ``127 / max|x|``), plus float32 accumulation error;
- the same quantization done in torch (``a = round(x * (127 / max|x|))`` in float32, round half to even) applied
  to the dequantized weight must match to float32 accumulation error: this pins the layout (nibble order, panel
  transposes, token and row tails) far tighter than the tolerance above.

Shapes: M not a multiple of the 4-token tile and beyond the 256-token block, K a multiple of 32, N not a multiple
of the 8-row panel; Q4 groups of 32/64/128, Q8_0 blocks and int8 per channel (codes -128 included).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.config import EngineConfig
from pagedserve.kernels.cpu_build import cpu_kernel_ops, unavailable_reason
from pagedserve.models.cpu_linear import (A8_MIN_TOKENS, StreamingInt4Linear, StreamingInt8Linear,
                                          use_int8_activations)
from pagedserve.models.quant import Int8BlockWeight, quantize_int4, quantize_int8_per_channel
from support import kernel_switch

needs_kernels = pytest.mark.skipif(cpu_kernel_ops() is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")


@pytest.fixture(params=["avx2", "avx-vnni"])
def isa(request):
    """Each tile: AVX2 (maddubs), and AVX-VNNI where the CPU has it (skipped elsewhere); restores the default."""
    yield from kernel_switch(torch.ops.pagedserve_cpu.linear_a8_vnni, request.param == "avx-vnni", "AVX-VNNI")

TOKEN_COUNTS = [1, 3, 6, 17, 258]   # tile of 4: tails 1, 3, 2, 1; 258: two token blocks of 256
EPS = torch.finfo(torch.float32).eps


def _quantize_acts(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^ in float64 [M, K], the step d per block [M, K // 32]) as the kernel rounds them: one level ``a * d``
    with ``d = max|x| / 127``; two levels ``Q * d`` with ``d = max|x| / 32512`` (the 16-bit value the two base-255
    int8 digits spell, linear_a8.hpp)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    qmax = 127.0 if levels == 1 else 32512.0
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(qmax) / amax, torch.zeros(()))   # float32, as in the kernel
    d = amax / qmax
    xq = torch.round(xb * inv).double() * d.double()
    return xq.view(m, k), d.squeeze(-1)


def _check(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None, levels: int,
           offset=None) -> None:
    """got against both oracles (module docstring). offset: |the part of W the kernel multiplies in integers| when
    it differs from |W| (Q4: q * scale, the min applied through the block sums), for the accumulation bound."""
    xq, d = _quantize_acts(x, levels)
    b = 0.0 if bias is None else bias.double()
    w = dense.double()
    nb = x.shape[1] // 32
    terms = xq.abs() @ (w.abs() if offset is None else offset.double() + w.abs()).t()
    accum = (4 * nb + 8) * EPS * terms + 1e-5
    emulated = xq @ w.t() + b
    assert ((got.double() - emulated).abs() <= accum).all(), (got.double() - emulated).abs().max()
    ref = F.linear(x.double(), w) + b
    tol = 0.5 * (1 + 1e-4) * (d.double().repeat_interleave(32, 1) @ w.abs().t()) + accum
    err = (got.double() - ref).abs()
    assert (err <= tol).all(), (err - tol).max()
    assert err.max() > 0   # the activations were rounded: the int8 path ran


@needs_kernels
@pytest.mark.parametrize("m", TOKEN_COUNTS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("levels", [1, 2])
def test_q4_a8_matches_dequantized_fp32(m, group, levels, isa):
    gen = torch.Generator().manual_seed(7 * m + group)
    q = quantize_int4(torch.randn(61, 384, generator=gen), group)   # 61 rows: 7 panels and 5 rows
    layer = StreamingInt4Linear(q, torch.randn(61, generator=gen))
    x = torch.randn(m, 384, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, 32:64] = 0.0                                            # a block of zeros: d = 0
    got = torch.ops.pagedserve_cpu.linear_q4_a8(x, layer.codes, layer.scales, layer.mins, group, layer.bias, levels)
    offset = (q.dequantize().double() - layer.mins.double().repeat_interleave(group, 1)).abs()
    _check(got, x, q.dequantize(), layer.bias, levels, offset)
    nobias = torch.ops.pagedserve_cpu.linear_q4_a8(x, layer.codes, layer.scales, layer.mins, group, None, levels)
    assert torch.allclose(nobias + layer.bias, got, atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m", TOKEN_COUNTS)
@pytest.mark.parametrize("levels", [1, 2])
def test_q8_a8_matches_dequantized_fp32(m, levels, isa):
    gen = torch.Generator().manual_seed(300 + m)
    codes = torch.randint(-128, 128, (45, 160), dtype=torch.int8, generator=gen)   # 45 rows: 5 panels and 5 rows
    codes[0, :8] = -128
    blocks = Int8BlockWeight(codes, (torch.rand(45, 5, generator=gen) / 50).half())
    channel = quantize_int8_per_channel(torch.randn(45, 160, generator=gen))
    x = torch.randn(m, 160, generator=gen)
    bias = torch.randn(45, generator=gen)
    for weight in (blocks, channel):
        layer = StreamingInt8Linear(weight, bias)
        got = torch.ops.pagedserve_cpu.linear_q8_a8(x, layer.codes, layer.scales, layer.group_size, layer.bias,
                                                    levels)
        _check(got, x, weight.dequantize(), bias, levels)


@needs_kernels
def test_layers_switch_to_int8_activations_at_min_tokens():
    """a8_min_tokens: below it the float-activation kernel (within float32 error of x @ W.T), from it the int8 one
    (bit-identical to calling the op); leading dimensions and bfloat16 pass through."""
    gen = torch.Generator().manual_seed(5)
    q4 = StreamingInt4Linear(quantize_int4(torch.randn(40, 96, generator=gen), 32))
    q8 = StreamingInt8Linear(quantize_int8_per_channel(torch.randn(40, 96, generator=gen)))
    assert (q4.a8_min_tokens, q8.a8_min_tokens) == (0, 0)
    model = torch.nn.Sequential(q4, torch.nn.Linear(40, 96), q8)
    assert use_int8_activations(model, 16, 1) == 2 and q4.a8_min_tokens == 16 == q8.a8_min_tokens
    ops = torch.ops.pagedserve_cpu
    small, big = torch.randn(15, 96, generator=gen), torch.randn(2, 8, 96, generator=gen)
    assert torch.equal(q4(small), ops.linear_q4(small, q4.codes, q4.scales, q4.mins, 32, None))
    flat = big.reshape(16, 96)
    assert torch.equal(q4(big).reshape(16, 40), ops.linear_q4_a8(flat, q4.codes, q4.scales, q4.mins, 32, None, 1))
    assert torch.equal(q8(big).reshape(16, 40), ops.linear_q8_a8(flat, q8.codes, q8.scales, 96, None, 1))
    use_int8_activations(model, 16, 2)
    assert torch.equal(q4(big).reshape(16, 40), ops.linear_q4_a8(flat, q4.codes, q4.scales, q4.mins, 32, None, 2))
    assert torch.equal(q8(small), ops.linear_q8(small, q8.codes, q8.scales, 96, None))
    assert q4(big.bfloat16()).dtype == torch.bfloat16
    use_int8_activations(model, 0)
    assert torch.equal(q4(flat), ops.linear_q4(flat, q4.codes, q4.scales, q4.mins, 32, None))


def test_int8_activation_settings_errors():
    with pytest.raises(ValueError, match="min_tokens"):
        use_int8_activations(torch.nn.Sequential(), -1)
    with pytest.raises(ValueError, match="levels"):
        use_int8_activations(torch.nn.Sequential(), 16, 3)
    with pytest.raises(ValueError, match="linear_kernels"):
        EngineConfig(linear_kernels="int8")
    with pytest.raises(ValueError, match="levels"):
        use_int8_activations(torch.nn.Sequential(), 16, 0)
    assert EngineConfig(linear_kernels="float-activations").linear_kernels == "float-activations"
    assert A8_MIN_TOKENS == 1   # every call: one scheme for every token count (batch invariance)


@needs_kernels
def test_a8_kernels_reject_bad_arguments():
    codes = torch.zeros(8, 24, dtype=torch.uint8)                   # K = 48: not a multiple of 32
    scales = torch.ones(8, 3)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.pagedserve_cpu.linear_q4_a8(torch.randn(2, 48), codes, scales, scales, 16, None, 1)
    with pytest.raises(RuntimeError, match="x has K"):
        torch.ops.pagedserve_cpu.linear_q8_a8(torch.randn(2, 32), torch.zeros(8, 64, dtype=torch.int8),
                                              torch.ones(8, 2), 32, None, 1)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.pagedserve_cpu.linear_q8_a8(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8),
                                              torch.ones(8, 3), 32, None, 1)
    with pytest.raises(RuntimeError, match="levels must be 1 or 2"):
        torch.ops.pagedserve_cpu.linear_q8_a8(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8),
                                              torch.ones(8, 2), 32, None, 3)


@needs_kernels
@pytest.mark.parametrize("m", TOKEN_COUNTS)
@pytest.mark.parametrize("levels", [1, 2])
def test_packed_panels_give_the_per_call_kernels_bits(m, levels, isa):
    """pack_a8_panels + linear_a8_packed (the panels packed once, at load) against linear_q4_a8 / linear_q8_a8 (the
    same panels repacked per call): bit-identical, with and without bias, N with a 5-row tail panel."""
    gen = torch.Generator().manual_seed(900 + m)
    ops = torch.ops.pagedserve_cpu
    x = torch.randn(m, 384, generator=gen) * 3
    x[0, :32] = 0.0
    bias = torch.randn(61, generator=gen)
    for group in (32, 128):
        q4 = StreamingInt4Linear(quantize_int4(torch.randn(61, 384, generator=gen), group))
        packed = ops.pack_a8_panels(q4.codes, q4.scales, q4.mins, group)
        assert [tuple(t.shape) for t in packed] == [(8, 384 * 8), (8, 12 * 8), (8, 12 * 8)]
        for b in (None, bias):
            want = ops.linear_q4_a8(x, q4.codes, q4.scales, q4.mins, group, b, levels)
            assert torch.equal(ops.linear_a8_packed(x, *packed, 61, b, levels), want)
    q8 = StreamingInt8Linear(quantize_int8_per_channel(torch.randn(61, 384, generator=gen)))
    packed = ops.pack_a8_panels(q8.codes, q8.scales, None, q8.group_size)
    assert packed[2].numel() == 0
    for b in (None, bias):
        want = ops.linear_q8_a8(x, q8.codes, q8.scales, q8.group_size, b, levels)
        assert torch.equal(ops.linear_a8_packed(x, *packed, 61, b, levels), want)


@needs_kernels
def test_layers_run_their_packed_panels_and_vnni_drops_them():
    """use_int8_activations packs each layer's panels (none when off); the layer's call is bit-identical to the
    per-call op either way; an int4 layer moved to the VNNI panels drops its 8-row copy."""
    from pagedserve.models.cpu_linear import use_vnni, vnni_available
    gen = torch.Generator().manual_seed(11)
    q4 = StreamingInt4Linear(quantize_int4(torch.randn(40, 96, generator=gen), 32))
    q8 = StreamingInt8Linear(quantize_int8_per_channel(torch.randn(40, 96, generator=gen)))
    model = torch.nn.Sequential(q4, q8)
    x = torch.randn(3, 96, generator=gen)
    use_int8_activations(model, 1, 2)
    assert q4.a8_panels is not None and q8.a8_panels is not None
    with_panels = q4(x), q8(x)
    q4.a8_panels = q8.a8_panels = None
    assert torch.equal(with_panels[0], q4(x)) and torch.equal(with_panels[1], q8(x))
    use_int8_activations(model, 0)
    assert q4.a8_panels is None and q8.a8_panels is None
    if vnni_available():
        use_int8_activations(model, 1, 2)
        use_vnni(model)
        assert q4.a8_panels is None and q8.a8_panels is None
        assert torch.equal(q4(x), with_panels[0]) and torch.equal(q8(x), with_panels[1])   # the VNNI panels' bits


@needs_kernels
def test_packed_panel_kernels_reject_bad_arguments():
    ops = torch.ops.pagedserve_cpu
    codes, scales = torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2)
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        ops.pack_a8_panels(codes.to(torch.int8), scales, scales, 32)
    with pytest.raises(RuntimeError, match="codes must be contiguous int8"):
        ops.pack_a8_panels(codes, scales, None, 32)
    packed = ops.pack_a8_panels(codes, scales, scales, 32)
    with pytest.raises(RuntimeError, match=r"packed must be contiguous uint8 \[ceil\(N / 8\)"):
        ops.linear_a8_packed(torch.randn(2, 64), *packed, 24, None, 1)    # N = 24: three panels, two packed
    with pytest.raises(RuntimeError, match="dw, mw must be"):
        ops.linear_a8_packed(torch.randn(2, 64), packed[0], packed[1][:, :8].contiguous(), packed[2], 16, None, 1)
    with pytest.raises(RuntimeError, match="levels must be 1 or 2"):
        ops.linear_a8_packed(torch.randn(2, 64), *packed, 16, None, 0)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.linear_a8_packed(torch.randn(2, 96), *packed, 16, None, 1)   # K of x differs from the panels'
