"""pagedserve's CPU linear kernels (kernels/csrc/linear_*.cpp, models/cpu_linear.py) against float64 references:
every token count of the small-M and blocked paths, N not a multiple of the row tile, bias, bad arguments, and the
layers built at load (float32 swap, tied LM head, GGUF Q4_1 and Q8_0 as stored)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_build import cpu_kernel_ops, unavailable_reason
from pagedserve.models.cpu_linear import (StreamingInt4Linear, StreamingInt8Linear, StreamingLinear,
                                          cpu_kernels_enabled, use_cpu_kernels)
from pagedserve.models.quant import Int4Weight, Int8BlockWeight, quantize_int4, quantize_int8_per_channel

needs_kernels = pytest.mark.skipif(cpu_kernel_ops() is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")

# fused (<= 4); float32 register-tile and panel paths (tails of 6); quantized row tiles (tails of 3); > 96 (token blocks)
TOKEN_COUNTS = [1, 2, 3, 4, 5, 9, 33, 70, 200]


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 accumulation error of a K-term dot product: a few ulps of sum |x| |w| per term."""
    return 4 * x.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t()) + 1e-6


@needs_kernels
@pytest.mark.parametrize("m", TOKEN_COUNTS)
def test_f32_kernel_matches_float64(m):
    gen = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, 200, generator=gen), torch.randn(301, 200, generator=gen), torch.randn(301, generator=gen)
    ref = F.linear(x.double(), w.double(), b.double())
    got = torch.ops.pagedserve_cpu.linear_f32(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (m, 301)
    assert ((got.double() - ref).abs() <= _bound(x, w)).all()
    assert torch.allclose(torch.ops.pagedserve_cpu.linear_f32(x, w, None).double(), ref - b.double(),
                          atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m", TOKEN_COUNTS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_layer_matches_dequantized_weight(m, group):
    """StreamingInt4Linear computes with the exact dequantized weights ((q - 8) * scale + zero), float32 math."""
    gen = torch.Generator().manual_seed(m * group)
    q = quantize_int4(torch.randn(97, 256, generator=gen), group)   # 97 rows: a tile of 1 left
    bias = torch.randn(97, generator=gen)
    x = torch.randn(m, 256, generator=gen)
    dense = q.dequantize()
    got = StreamingInt4Linear(q, bias)(x)
    ref = F.linear(x.double(), dense.double(), bias.double())
    assert ((got.double() - ref).abs() <= _bound(x, dense) + 1e-5 * ref.abs()).all()


@needs_kernels
@pytest.mark.parametrize("m", TOKEN_COUNTS)
def test_int8_layers_match_dequantized_weight(m):
    """Q8_0 blocks (group 32, float16 scales) and int8 per output channel (one group of K)."""
    gen = torch.Generator().manual_seed(100 + m)
    codes = torch.randint(-127, 128, (51, 96), dtype=torch.int8, generator=gen)   # 51 rows: a tile of 3 left
    blocks = Int8BlockWeight(codes, (torch.rand(51, 3, generator=gen) / 50).half())
    channel = quantize_int8_per_channel(torch.randn(51, 96, generator=gen))
    x = torch.randn(m, 96, generator=gen)
    for weight in (blocks, channel):
        dense = weight.dequantize()
        got = StreamingInt8Linear(weight)(x)
        ref = F.linear(x.double(), dense.double())
        assert ((got.double() - ref).abs() <= _bound(x, dense)).all()


@needs_kernels
def test_layers_keep_shapes_and_dtype():
    """Leading dimensions pass through; bfloat16 activations come back bfloat16."""
    w = torch.randn(24, 64)
    layer = StreamingLinear(w)
    x = torch.randn(2, 3, 64)
    assert layer(x).shape == (2, 3, 24)
    assert torch.allclose(layer(x), F.linear(x, w), atol=1e-5)
    q4 = StreamingInt4Linear(quantize_int4(w, 32))
    assert q4(x.bfloat16()).dtype == torch.bfloat16


@needs_kernels
@pytest.mark.parametrize("kind", ["f32", "q4", "q8", "q4_a8x2", "q8_a8x2", "q4_a8x1", "q4_vnni2", "q4_vnni1"])
def test_every_kernel_is_row_invariant(kind):
    """Batch invariance of the linears: a row's output is the same bits whether it is alone in the call or the row of
    a 1- to 300-row call, on one thread or two (tiles over output rows only, K reduced in a fixed order)."""
    from pagedserve.models.cpu_linear import vnni_available
    if "vnni" in kind and not vnni_available():
        pytest.skip("no AVX-512 VNNI here")
    ops = torch.ops.pagedserve_cpu
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 256, generator=gen) * 0.05
    q4 = StreamingInt4Linear(quantize_int4(w, 32))
    q8 = StreamingInt8Linear(Int8BlockWeight(torch.randint(-127, 128, (200, 256), dtype=torch.int8, generator=gen),
                                             (torch.rand(200, 8, generator=gen) / 50).half()))
    packed = ops.pack_q4_vnni(q4.codes, q4.scales, q4.mins, 32) if "vnni" in kind else None
    levels = 2 if kind.endswith("x2") or kind.endswith("2") else 1
    run = {"f32": lambda x: ops.linear_f32(x, w, None),
           "q4": lambda x: ops.linear_q4(x, q4.codes, q4.scales, q4.mins, 32, None),
           "q8": lambda x: ops.linear_q8(x, q8.codes, q8.scales, 32, None),
           "q4_a8x2": lambda x: ops.linear_q4_a8(x, q4.codes, q4.scales, q4.mins, 32, None, levels),
           "q4_a8x1": lambda x: ops.linear_q4_a8(x, q4.codes, q4.scales, q4.mins, 32, None, levels),
           "q8_a8x2": lambda x: ops.linear_q8_a8(x, q8.codes, q8.scales, 32, None, levels),
           "q4_vnni2": lambda x: ops.linear_q4_vnni(x, *packed, 200, None, levels),
           "q4_vnni1": lambda x: ops.linear_q4_vnni(x, *packed, 200, None, levels)}[kind]
    x = torch.randn(300, 256, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = run(x)
        torch.set_num_threads(1)
        for m in (1, 2, 3, 4, 5, 17, 64, 299):
            assert torch.equal(run(x[:m].contiguous()), full[:m]), m
        assert torch.equal(run(x[250:251].contiguous())[0], full[250])
    finally:
        torch.set_num_threads(threads)
    if "vnni" in kind:   # the panels give linear_q4_a8's bits (the AVX2 machines' kernel)
        assert torch.equal(full, ops.linear_q4_a8(x, q4.codes, q4.scales, q4.mins, 32, None, levels))


@needs_kernels
def test_bad_arguments_raise():
    ops = torch.ops.pagedserve_cpu
    w = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="x has K=32"):
        ops.linear_f32(torch.randn(2, 32), w, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear_f32(torch.randn(2, 64).double(), w, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_q8(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 3), 48, None)
    with pytest.raises(ValueError, match="multiple of 32"):
        StreamingInt4Linear(Int4Weight(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 3), torch.zeros(8, 3),
                                       16, "t"))
    with pytest.raises(ValueError, match="linear_kernels"):
        cpu_kernels_enabled("fast", torch.device("cpu"))


@needs_kernels
def test_use_cpu_kernels_swaps_linears_and_ties_lm_head():
    """float32 nn.Linear leaves become StreamingLinear sharing their weight; a tied LM head is built over the
    embedding's storage (no copy)."""
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(50, 16)
    model.proj = torch.nn.Linear(16, 24)
    model.odd = torch.nn.Linear(12, 4)          # K not a multiple of 8: left alone
    model.lm_head = None
    weight_ptr = model.proj.weight.data_ptr()
    assert use_cpu_kernels(model) == 2
    assert isinstance(model.proj, StreamingLinear) and model.proj.weight.data_ptr() == weight_ptr
    assert type(model.odd) is torch.nn.Linear
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    h = torch.randn(3, 16)
    assert torch.allclose(model.lm_head(h), h @ model.embed_tokens.weight.t(), atol=1e-5)


@needs_kernels
def test_embedded_gguf_layers_exact(llm_int4, llm_parts):
    """The embedded GGUF on the own kernels' float-activation paths: Q4_1 linears and the Q8_0 tied LM head as
    stored give the dequantized fp32 model's outputs within float32 rounding (no bfloat16 anywhere). The int8
    activation paths ("auto"'s, every call) are off for this check; their accuracy is tests/models/test_quant.py's."""
    from pagedserve.models.cpu_linear import use_int8_activations, use_vnni

    if llm_int4.linear_kernels != "pagedserve-cpu":
        pytest.skip("the int4 model was built on torch's kernels")
    fp32 = llm_parts[0]
    assert "lm_head Q8_0 (as stored)" in llm_int4.quantization
    h = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    use_vnni(llm_int4, 0)
    use_int8_activations(llm_int4, 0)
    try:
        for got_layer, ref_layer in ((llm_int4.layers[3].mlp, fp32.layers[3].mlp),
                                     (llm_int4.compute_logits, fp32.compute_logits)):
            got, ref = got_layer(h), ref_layer(h)
            assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    finally:
        use_int8_activations(llm_int4, llm_int4.a8_min_tokens, llm_int4.a8_levels or 2)
        use_vnni(llm_int4, llm_int4.vnni_max_tokens)


def test_kernels_build_where_they_should():
    """On an x86-64 CPU with AVX2 and a C++ compiler the library must build and load (so the tests above cannot
    skip silently on a machine where they are meant to run)."""
    import platform
    import shutil

    if platform.machine().lower() not in ("x86_64", "amd64") or \
            torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or \
            not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no AVX2 x86-64 CPU or no C++ compiler here")
    assert cpu_kernel_ops() is not None, unavailable_reason()
