"""Linear layers over pagedserve's own CPU kernels (:mod:`pagedserve.kernels.cpu_build`), chosen at load.

The kernels in ``csrc/linear_*.cpp`` take float32, 4-bit and 8-bit weights with float32 activations (torch's
int4/int8 CPU kernels are vectorized only for bfloat16 activations).

Layers (x: ``[..., K]`` in the compute dtype; returns ``[..., N]`` in x's dtype): :class:`StreamingLinear` (float32
``[N, K]``), :class:`StreamingInt4Linear` (GGUF-order codes, ``w = q * scale + min``, ``min = zero - 8 * scale``),
:class:`StreamingInt8Linear` (int8 codes, a scale per group along K: GGUF Q8_0, exact, or per output channel).

One numeric scheme per layer for every token count (batch invariance): a row's output is a function of that row
and the weights alone, bit for bit, whether the call carries one decode token or a 1,024-token prefill chunk beside
it, on any thread count (each kernel splits the work over output rows only and reduces K in a fixed order). The
schemes, by ``linear_kernels`` choice (EngineConfig.linear_kernels):

- ``"auto"`` (the default): the quantized layers on int8 activations in two levels at every call: x per token
  and block of 32 quantized to 16 bits (``d = max|x| / 32512``) held as two int8 digits in base 255, each
  multiplied with exact integer dot products, the sums combined in int32, one float step per block (then the q4
  min term): csrc/linear_a8.hpp. Kernels, all with the same bits (tested; use_amx checks AMX again at load): int4
  layers on ``linear_q4_vnni`` where the CPU has AVX-512 VNNI (16-row panels packed at load), else
  ``linear_a8_packed`` (AVX2 / AVX-VNNI, 8-row panels packed at load; ``linear_q4_a8`` repacks per call), and
  ``linear_q4_amx`` from :data:`AMX_MIN_TOKENS` tokens with AMX-INT8; int8 layers on ``linear_q8_vnni`` with
  AVX-512 VNNI, else ``linear_a8_packed`` (``linear_q8_a8``'s function); float32 layers on ``linear_f32``.
  Teacher-forced 2,000 tokens of the embedded model against float32 activations: top-1 1.0000, perplexity +0.00%.
- ``"int8-activations"``: one level (llama.cpp's numerics, the fastest; top-1 agreement 0.970, perplexity +0.25%).
- ``"float-activations"``: float32 activations at every call (``linear_q4`` / ``linear_q8``: each weight row decoded
  into an L1 buffer, register tiles with k in the lanes): the float32 function of the quantized weights.

The float32 GEMM of the decoded weight (:func:`use_dequantized_gemm`, not batch-invariant) is bench/prefill.py's
baseline. :func:`use_cpu_kernels` swaps float32 ``nn.Linear`` leaves; :mod:`.quant_load` builds the quantized ones.
"""
from __future__ import annotations

import functools

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from ..config import LINEAR_KERNELS
from ..kernels.cpu_build import cpu_kernel_ops
from .quant import Int4Weight, Int8BlockWeight, Int8ChannelWeight

log = structlog.get_logger(__name__)

# One numeric scheme per layer for every token count (README, "Deterministic outputs"): the thresholds below are 1
# or unbounded; a layer's kernel is chosen once, at load, by the CPU's features. int8 activations from token 1:
A8_MIN_TOKENS = 1
A8_LEVELS = {"auto": 2, "int8-activations": 1}   # levels by linear_kernels choice (others: none)
DQ_MIN_TOKENS = 64   # the float32 GEMM of the decoded weight: no choice takes it (bench/prefill.py's baseline)
DQ_MAX_WEIGHTS = 1 << 22   # larger weights (an LM head: 28 M) keep the own kernels: no 100+ MB float32 copy per call
# Tokens from which "auto" / "int8-activations" run the int4 layers on AMX tiles where the CPU has AMX-INT8
# (linear_q4_amx: the panels' bits, checked at load by use_amx; figures: bench/README.md, "AMX").
AMX_MIN_TOKENS, AMX_CHOICES = 16, ("auto", "int8-activations")
# Tokens up to which "auto" / "int8-activations" run the int4 and int8 layers on the AVX-512 VNNI panels where the
# CPU has them: every call (int4 1536 x 576, two levels, 2 threads, AMD EPYC without AMX, GFLOP/s-eq vs the decoded
# float32 GEMM: M=1 214 vs 18, M=32 451 vs 138, M=1024 363 vs 200; the int8 head: bench/README.md, 2026-12-07).
VNNI_MAX_TOKENS, VNNI_CHOICES = 1 << 62, AMX_CHOICES


def cpu_kernels_enabled(choice: str, device: torch.device) -> bool:
    """Whether to build layers over the own kernels: any ``choice`` but "torch" on a CPU device where they load.

    Raises:
        ValueError: an unknown ``choice`` (one of :data:`LINEAR_KERNELS`).
    """
    if choice not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernels: unknown choice {choice!r}; one of {LINEAR_KERNELS}")
    return choice != "torch" and torch.device(device).type == "cpu" and cpu_kernel_ops() is not None


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x = x.reshape(-1, k) if x.dim() != 2 else x
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    return x if x.is_contiguous() else x.contiguous()


def _like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 ``[M, N]`` output in ``x``'s dtype and leading dimensions."""
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _takes(x: torch.Tensor, k: int, min_tokens: int) -> bool:
    """Whether a call on ``x`` (rows of ``k``) is long enough for a path taken from ``min_tokens`` (0: never)."""
    return min_tokens > 0 and x.numel() >= min_tokens * k


def _a8_call(layer: nn.Module, rows: torch.Tensor, args: tuple, per_call, float_act) -> torch.Tensor:
    """A quantized layer's int8-activation call (on its packed 8-row panels when it has them, else ``per_call``,
    which packs them per call: the same bits) or, below ``a8_min_tokens``, its float-activation call."""
    if not _takes(rows, layer.in_features, layer.a8_min_tokens):
        return float_act(*args)
    if layer.a8_panels is not None:
        return torch.ops.pagedserve_cpu.linear_a8_packed(rows, *layer.a8_panels, layer.out_features, layer.bias,
                                                         layer.a8_levels)
    return per_call(*args, layer.a8_levels)


def _set_vnni(layer: nn.Module, max_tokens: int, attr: str, pack) -> None:
    """A layer's ``set_vnni``: its ``attr`` panels packed by ``pack()`` on first use (dropped at 0), its 8-row
    panels dropped when the VNNI panels serve every call."""
    if max_tokens >= VNNI_MAX_TOKENS:
        layer.a8_panels = None
    if max_tokens and getattr(layer, attr) is None:
        setattr(layer, attr, tuple(pack()))
    elif not max_tokens:
        setattr(layer, attr, None)
    layer.vnni_max_tokens = max_tokens


def _bias(bias: torch.Tensor | None) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.detach().to(torch.float32).contiguous(), requires_grad=False)


class StreamingLinear(nn.Module):
    """float32 ``y = x @ weight.T (+ bias)``; weight ``[N, K]`` float32 contiguous, K a multiple of 8."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = _bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pagedserve_cpu.linear_f32(x.reshape(-1, self.in_features).contiguous(), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, float32"


class StreamingInt4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` for an :class:`Int4Weight` (group size a multiple of 32 dividing K).

    Buffers: ``codes`` uint8 ``[N, K // 2]`` (each 32 weights as 16 bytes: weight j in the low nibble of byte j,
    weight j + 16 in its high nibble), ``scales`` and ``mins`` float32 ``[N, K // group_size]``. ``a8_min_tokens``:
    tokens from which a call runs on int8 activations, ``dq_min_tokens`` on the float32 GEMM of the decoded weight,
    ``amx_min_tokens`` on int8 activations on AMX tiles (0: never; see the module docstring).

    Raises:
        ValueError: a group size that is not a multiple of 32 dividing K.
    """

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = weight.codes.shape
        g = weight.group_size
        if g % 32 or k % g:
            raise ValueError(f"int4 kernel: group size {g} must be a multiple of 32 dividing K={k}")
        self.out_features, self.in_features, self.group_size, self.source = n, k, g, weight.source
        halves = weight.codes.view(n, k // 32, 2, 16)
        self.register_buffer("codes", (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous())
        self.register_buffer("scales", weight.scales.to(torch.float32).contiguous())
        self.register_buffer("mins", (weight.zeros - 8.0 * weight.scales).to(torch.float32).contiguous())
        self.bias = _bias(bias)
        self.a8_min_tokens, self.a8_levels, self.dq_min_tokens, self.amx_min_tokens = 0, 2, 0, 0
        self.vnni_max_tokens, self.vnni_panels, self.a8_panels = 0, None, None

    def dequantize(self) -> torch.Tensor:
        """The weight decoded to float32 ``[N, K]`` (``q * scale + min``, one FMA each)."""
        return torch.ops.pagedserve_cpu.dequantize_q4(self.codes, self.scales, self.mins, self.group_size)

    def set_vnni(self, max_tokens: int) -> None:
        """Calls of up to ``max_tokens`` tokens run ``linear_q4_vnni`` (0: never; the packed copy is dropped). The
        first call with ``max_tokens`` > 0 packs the weight (``pack_q4_vnni``: codes uint8 ``[ceil(N / 16),
        K // 32 * 256]``, scales and mins float32 ``[ceil(N / 16), K // 32 * 16]``)."""
        _set_vnni(self, max_tokens, "vnni_panels", lambda: torch.ops.pagedserve_cpu.pack_q4_vnni(
            self.codes, self.scales, self.mins, self.group_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.pagedserve_cpu
        rows = _rows(x, self.in_features)
        if rows.shape[0] <= self.vnni_max_tokens:
            return _like(ops.linear_q4_vnni(rows, *self.vnni_panels, self.out_features, self.bias, self.a8_levels), x)
        args = (rows, self.codes, self.scales, self.mins, self.group_size, self.bias)
        if _takes(rows, self.in_features, self.amx_min_tokens):
            return _like(ops.linear_q4_amx(*args, self.a8_levels), x)
        if _takes(rows, self.in_features, self.dq_min_tokens):
            return _like(F.linear(rows, self.dequantize(), self.bias), x)
        return _like(_a8_call(self, rows, args, ops.linear_q4_a8, ops.linear_q4), x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}, source={self.source}"


class StreamingInt8Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` for int8 codes with a scale per group along K.

    Built from an :class:`Int8BlockWeight` (GGUF Q8_0: group 32, float16 scales widened exactly to float32) or an
    :class:`Int8ChannelWeight` (one group of K per row). Buffers: ``codes`` int8 ``[N, K]``, ``scales`` float32
    ``[N, K // group_size]``. ``a8_min_tokens`` and ``dq_min_tokens`` as for :class:`StreamingInt4Linear` (int8
    activations need K and the group size to be multiples of 32; :func:`use_int8_activations` skips other layers).
    """

    def __init__(self, weight: Int8BlockWeight | Int8ChannelWeight, bias: torch.Tensor | None = None,
                 source: str = "int8"):
        super().__init__()
        n, k = weight.codes.shape
        self.out_features, self.in_features, self.source = n, k, source
        if isinstance(weight, Int8BlockWeight):
            self.group_size, scales = weight.block_size, weight.scales
        else:
            self.group_size, scales = k, weight.scales.reshape(n, 1)
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.bias = _bias(bias)
        self.a8_min_tokens, self.a8_levels, self.dq_min_tokens, self.a8_panels = 0, 2, 0, None
        self.vnni_max_tokens, self.q8_vnni_panels = 0, None

    def dequantize(self) -> torch.Tensor:
        """The weight decoded to float32 ``[N, K]`` (``q * scale``)."""
        return torch.ops.pagedserve_cpu.dequantize_q8(self.codes, self.scales, self.group_size)

    def set_vnni(self, max_tokens: int) -> None:
        """Calls of up to ``max_tokens`` tokens run ``linear_q8_vnni`` (``linear_q8_a8``'s bits on 16-row panels,
        AVX-512 VNNI; 0: never, the copy dropped), packed on first use (``pack_q8_vnni``: codes + 128 uint8
        ``[ceil(N / 16), K // 32 * 512]``, scales float32 ``[ceil(N / 16), K // 32 * 16]``). Not ``vnni_panels``:
        the fused decode stack takes int4 layers only."""
        _set_vnni(self, max_tokens, "q8_vnni_panels", lambda: torch.ops.pagedserve_cpu.pack_q8_vnni(
            self.codes, self.scales, self.group_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.pagedserve_cpu
        rows = _rows(x, self.in_features)
        if rows.shape[0] <= self.vnni_max_tokens:
            return _like(ops.linear_q8_vnni(rows, *self.q8_vnni_panels, self.out_features, self.bias,
                                            self.a8_levels), x)
        if _takes(rows, self.in_features, self.dq_min_tokens):
            return _like(F.linear(rows, self.dequantize(), self.bias), x)
        args = (rows, self.codes, self.scales, self.group_size, self.bias)
        return _like(_a8_call(self, rows, args, ops.linear_q8_a8, ops.linear_q8), x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}, source={self.source}"


def use_cpu_kernels(model: nn.Module) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` whose K is a multiple of 8 by a :class:`StreamingLinear`
    sharing its weight; a tied LM head (``model.lm_head`` None beside a float32 ``nn.Embedding`` ``embed_tokens``)
    becomes one over the embedding's weight (shared, not copied). Returns how many layers were built (0 when the
    kernels did not load)."""
    if cpu_kernel_ops() is None:
        return 0
    swapped = 0
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and type(embed) is nn.Embedding and \
            embed.weight.dtype == torch.float32 and embed.embedding_dim % 8 == 0:
        model.lm_head = StreamingLinear(embed.weight.data)
        swapped += 1
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.in_features % 8 == 0 \
                and module.weight.device.type == "cpu":
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    StreamingLinear(module.weight.data, None if module.bias is None else module.bias.data))
            swapped += 1
    return swapped


def use_int8_activations(model: nn.Module, min_tokens: int = A8_MIN_TOKENS, levels: int = 2) -> int:
    """Set ``a8_min_tokens = min_tokens`` (0: int8 activations off) and ``a8_levels = levels`` on every
    :class:`StreamingInt4Linear` and :class:`StreamingInt8Linear` of ``model`` whose K and group size are multiples
    of 32, and pack their 8-row panels (``pack_a8_panels``: codes uint8 ``[ceil(N / 8), K * 8]``, scales (and
    mins) float32 ``[ceil(N / 8), K // 32 * 8]``; :func:`use_vnni` drops an int4 layer's, the VNNI panels serving
    its calls). Returns how many layers were set.

    Raises:
        ValueError: a negative ``min_tokens``, ``levels`` other than 1 or 2.
    """
    if min_tokens < 0:
        raise ValueError(f"min_tokens: must be >= 0, got {min_tokens}")
    if levels not in (1, 2):
        raise ValueError(f"levels: must be 1 or 2, got {levels}")
    layers = _a8_layers(model, StreamingInt4Linear, StreamingInt8Linear)
    for module in layers:
        module.a8_min_tokens, module.a8_levels = min_tokens, levels
        mins = (module.mins,) if isinstance(module, StreamingInt4Linear) else (None,)
        module.a8_panels = tuple(torch.ops.pagedserve_cpu.pack_a8_panels(
            module.codes, module.scales, *mins, module.group_size)) if min_tokens else None
    return len(layers)


def use_dequantized_gemm(model: nn.Module, min_tokens: int = DQ_MIN_TOKENS) -> int:
    """Set ``dq_min_tokens = min_tokens`` (0: off) on every :class:`StreamingInt4Linear` and
    :class:`StreamingInt8Linear` of ``model`` with at most :data:`DQ_MAX_WEIGHTS` weights: from that many tokens a
    call decodes its weight to float32 and runs torch's GEMM (the module docstring). Returns how many layers were set.

    Raises:
        ValueError: a negative ``min_tokens``.
    """
    if min_tokens < 0:
        raise ValueError(f"min_tokens: must be >= 0, got {min_tokens}")
    layers = [m for m in model.modules() if isinstance(m, (StreamingInt4Linear, StreamingInt8Linear))
              and m.in_features * m.out_features <= DQ_MAX_WEIGHTS]
    for module in layers:
        module.dq_min_tokens = min_tokens
    return len(layers)


def amx_available() -> bool:
    """Whether ``linear_q4_amx`` runs here: the own kernels loaded, and the CPU and the OS provide AMX-INT8."""
    return cpu_kernel_ops() is not None and bool(torch.ops.pagedserve_cpu.linear_amx_available())


def _check_switch(value: int, name: str, available, what: str) -> None:
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")
    if value and not available():
        raise RuntimeError(f"{what} is not available on this CPU (or the kernels did not load)")


def _a8_layers(model: nn.Module, *classes: type) -> list[nn.Module]:
    """The layers of ``model`` of ``classes`` whose K and group size are multiples of 32 (int8 activations)."""
    return [m for m in model.modules() if isinstance(m, classes) and m.in_features % 32 == 0 and m.group_size % 32 == 0]


@functools.cache
def amx_matches_panels() -> bool:
    """Whether ``linear_q4_amx`` gives ``linear_q4_a8``'s bits here, one level and two (a seeded 61 x 384 int4 layer,
    37 tokens, a zero block included); False where AMX does not run."""
    if not amx_available():
        return False
    from .quant import quantize_int4
    gen = torch.Generator().manual_seed(0)
    layer = StreamingInt4Linear(quantize_int4(torch.randn(61, 384, generator=gen), 32))
    x = torch.randn(37, 384, generator=gen)
    x[0, 32:64] = 0.0
    args = (x, layer.codes, layer.scales, layer.mins, 32, None)
    ops = torch.ops.pagedserve_cpu
    return all(torch.equal(ops.linear_q4_amx(*args, levels), ops.linear_q4_a8(*args, levels)) for levels in (1, 2))


def use_amx(model: nn.Module, min_tokens: int = AMX_MIN_TOKENS) -> int:
    """Set ``amx_min_tokens = min_tokens`` (0: off) on every :class:`StreamingInt4Linear` of ``model`` whose K and
    group size are multiples of 32: from that many tokens a call runs ``linear_q4_amx`` with the layer's
    ``a8_levels``. Returns how many layers were set.

    Raises:
        ValueError: a negative ``min_tokens``.
        RuntimeError: ``min_tokens`` > 0 where :func:`amx_available` is false.
    """
    _check_switch(min_tokens, "min_tokens", amx_available, "AMX-INT8")
    if min_tokens and not amx_matches_panels():
        log.warning("amx_kernel_off", reason="linear_q4_amx differs from linear_q4_a8 on this CPU: AMX stays off so "
                    "that every token count gets the same bits")
        min_tokens = 0
    layers = _a8_layers(model, StreamingInt4Linear)
    for module in layers:
        module.amx_min_tokens = min_tokens
    return len(layers)


def linear_path_of(model: nn.Module) -> str:
    """One line naming the kernels the model's linears run, e.g. "int8 activations x2 (int4: avx512-vnni panels,
    amx from 16 tokens; int8: avx2 panels); float32: own kernel", from the layers' settings."""
    q4, q8 = ([m for m in model.modules() if isinstance(m, cls)] for cls in (StreamingInt4Linear, StreamingInt8Linear))
    parts = []
    levels = max([m.a8_levels for m in q4 + q8 if m.a8_min_tokens] or [0])
    avx2 = "avx-vnni" if (q4 or q8) and bool(torch.ops.pagedserve_cpu.linear_a8_vnni(-1)) else "avx2"
    if levels:
        amx = max((m.amx_min_tokens for m in q4), default=0)
        kinds = [f"int4: {'avx512-vnni' if any(m.vnni_max_tokens for m in q4) else avx2} panels"
                 + (f", amx from {amx} tokens" if amx else "")] if q4 else []
        kinds += [f"int8: {'avx512-vnni' if any(m.vnni_max_tokens for m in q8) else avx2} panels"] if q8 else []
        parts.append(f"int8 activations x{levels} ({'; '.join(kinds)})")
    elif q4 or q8:
        parts.append("float32 activations (int4/int8 decoded per row)")
    if any(isinstance(m, StreamingLinear) for m in model.modules()):
        parts.append("float32: own kernel")
    return "; ".join(parts) or "none"


def vnni_available() -> bool:
    """Whether ``linear_q4_vnni`` runs here: the own kernels loaded, and the CPU has AVX-512 F/BW/VL/VNNI."""
    return cpu_kernel_ops() is not None and bool(torch.ops.pagedserve_cpu.linear_vnni_available())


def use_vnni(model: nn.Module, max_tokens: int = VNNI_MAX_TOKENS) -> int:
    """Set ``vnni_max_tokens = max_tokens`` (0: off, the packed copies dropped) on every :class:`StreamingInt4Linear`
    and :class:`StreamingInt8Linear` of ``model`` whose K and group size are multiples of 32, packing each weight on
    first use (their ``set_vnni``): calls of up to that many tokens run ``linear_q4_vnni`` / ``linear_q8_vnni`` with
    the layer's ``a8_levels`` (the bits of ``linear_q4_a8`` / ``linear_q8_a8``). On a model with a
    ``refresh_fused_decode`` method (Llama) its one-call decode stack (:mod:`.fused_decode`) is rebuilt or dropped.
    Returns how many layers were set.

    Raises:
        ValueError: a negative ``max_tokens``.
        RuntimeError: ``max_tokens`` > 0 where :func:`vnni_available` is false.
    """
    _check_switch(max_tokens, "max_tokens", vnni_available, "AVX-512 VNNI")
    layers = _a8_layers(model, StreamingInt4Linear, StreamingInt8Linear)
    for module in layers:
        module.set_vnni(max_tokens)
    refresh = getattr(model, "refresh_fused_decode", None)   # a Llama: its one-call decode stack follows the panels
    if refresh is not None:
        refresh()
    return len(layers)
