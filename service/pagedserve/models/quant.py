"""Quantized weights and the weight-only quantized layers that run them (CPU kernels of torch).

Three weight forms, each holding integer codes and the floats that turn them into values (all exact: the value of a
weight is computed in float32 from the codes and the scales, with one rounding at most, as ``gguf`` does):

- :class:`Int4Weight`: 4-bit codes with a scale and a zero per group of ``group_size`` weights along K, torch's
  int4 weight-only formula ``w = (q - 8) * scale + zero``. GGUF Q4_1 (``w = d * q + m``) maps onto it with
  ``scale = d``, ``zero = m + 8 d`` (exact in float32 for every block of the embedded model; checked at load);
  GGUF Q4_0 (``w = d * (q - 8)``) with ``scale = d``, ``zero = 0``.
- :class:`Int8BlockWeight`: GGUF Q8_0, int8 codes with one float16 scale per block of 32 (``w = d * q``).
- :class:`Int8ChannelWeight`: int8 codes with one scale per output channel (``w = scale[n] * q``).

The layers: :class:`Int4Linear` (``torch.ops.aten._weight_int4pack_mm_for_cpu``), :class:`Int8Linear`
(``torch.ops.aten._weight_int8pack_mm``) and :class:`Q8Embedding` (rows dequantized at lookup, exactly). On this
project's AVX2 CPUs only the bfloat16-activation paths of those kernels are vectorized (float32 and float16
activations run a scalar loop, 10-40x slower, measured in bench/README.md), so the layers round their input to
bfloat16, the kernel's scales are bfloat16 copies of the float32 ones (int4 zeros are applied in float32 beside the
kernel), and the output is cast back to the compute dtype. The stored codes and float32 scales stay the exact ones
(see ``dequantize``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

KERNEL_DTYPE = torch.bfloat16   # activation / scale dtype of torch's vectorized CPU int4 and int8 kernels
INT4_GROUP_SIZES = (32, 64, 128, 256)   # group sizes _weight_int4pack_mm_for_cpu accepts
INT4_N_MULTIPLE = 16            # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0


@dataclass(frozen=True)
class Int4Weight:
    """``w[n, k] = (codes[n, k] - 8) * scales[n, k // group_size] + zeros[n, k // group_size]`` in float32.

    codes: uint8 ``[N, K]``, values 0..15. scales, zeros: float32 ``[N, K // group_size]``.
    source: where it came from ("Q4_1", "Q4_0": the GGUF blocks as stored; "int4": quantized at load).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    source: str

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: the value of every weight (bit for bit gguf's dequantization for GGUF sources)."""
        g = self.group_size
        q = self.codes.to(torch.float32) - 8.0
        return torch.addcmul(self.zeros.repeat_interleave(g, 1), q, self.scales.repeat_interleave(g, 1))

    def rows(self, index: torch.Tensor) -> "Int4Weight":
        return Int4Weight(self.codes[index], self.scales[index], self.zeros[index], self.group_size, self.source)

    def cols(self, start: int, end: int) -> "Int4Weight":
        """Input columns ``[start, end)`` (a row-parallel shard). Raises ValueError off the group boundaries."""
        g = self.group_size
        if start % g or end % g:
            raise ValueError(f"int4 weight: columns [{start}, {end}) do not fall on its groups of {g}")
        return Int4Weight(self.codes[:, start:end].contiguous(), self.scales[:, start // g:end // g].contiguous(),
                          self.zeros[:, start // g:end // g].contiguous(), g, self.source)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Concatenate along N (fused QKV, gate/up). Raises ValueError for different group sizes."""
        if len({p.group_size for p in parts}) != 1:
            raise ValueError(f"cannot fuse int4 weights of group sizes {[p.group_size for p in parts]}")
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]), parts[0].group_size,
                          "+".join(sorted({p.source for p in parts})))


@dataclass(frozen=True)
class Int8BlockWeight:
    """GGUF Q8_0: ``w[n, k] = codes[n, k] * scales[n, k // 32]``. codes int8 ``[N, K]``; scales float16
    ``[N, K // 32]`` as stored (the product is exact in float32: 8 x 11 significant bits)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block_size: int = 32

    def dequantize(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[N, K]`` (or ``[len(index), K]`` for the rows ``index``)."""
        codes = self.codes if index is None else self.codes[index]
        scales = self.scales if index is None else self.scales[index]
        n, k = codes.shape
        return (codes.to(torch.float32).view(n, k // self.block_size, self.block_size)
                * scales.to(torch.float32).unsqueeze(-1)).view(n, k)

    def cols(self, start: int, end: int) -> "Int8BlockWeight":
        """Input columns ``[start, end)`` (a row-parallel shard). Raises ValueError off the block boundaries."""
        b = self.block_size
        if start % b or end % b:
            raise ValueError(f"Q8_0 weight: columns [{start}, {end}) do not fall on its blocks of {b}")
        return Int8BlockWeight(self.codes[:, start:end].contiguous(), self.scales[:, start // b:end // b].contiguous(),
                               b)

    def rows(self, index: torch.Tensor) -> "Int8BlockWeight":
        return Int8BlockWeight(self.codes[index], self.scales[index], self.block_size)


@dataclass(frozen=True)
class Int8ChannelWeight:
    """``w[n, k] = codes[n, k] * scales[n]``: codes int8 ``[N, K]``, scales float32 ``[N]``."""

    codes: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[N, K]`` (or the rows ``index``)."""
        if index is None:
            return self.codes.to(torch.float32) * self.scales[:, None]
        return self.codes[index].to(torch.float32) * self.scales[index][:, None]


QuantizedWeight = Int4Weight | Int8BlockWeight | Int8ChannelWeight


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric min/max int4 per group of ``group_size`` along K (round to nearest).

    w: ``[N, K]`` float. Raises ValueError when K is not a multiple of ``group_size``.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: K={k} is not a multiple of the group size {group_size}")
    g = w.to(torch.float32).reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return Int4Weight(codes, scales, lo + 8 * scales, group_size, "int4")


def quantize_int8_per_channel(w: torch.Tensor) -> Int8ChannelWeight:
    """Symmetric int8 per output channel: ``scale = max|w[n]| / 127``, codes round to nearest. w: ``[N, K]``."""
    w = w.to(torch.float32)
    scales = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8ChannelWeight(codes, scales)


def _to_kernel_input(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).to(KERNEL_DTYPE)


class Int4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W an :class:`Int4Weight`, through ``_weight_int4pack_mm_for_cpu``.

    The kernel computes ``sum_k x[m, k] * (q[n, k] - 8) * scale[n, g(k)] (+ zero[n, g(k)])`` with its scales and
    zeros in bfloat16 (its only vectorized CPU path). The zeros are kept out of it: the kernel gets zero 0, and
    ``sum_g (sum_{k in g} x[m, k]) * zero[n, g]`` is added in float32 with the exact zeros (Q4_1's ``m + 8 d``);
    rounding them to bfloat16 cost a quarter of the int4 model's top-1 disagreements with the fp32 model
    (tests/test_quant.py). Only the scales are rounded (float16 ``d`` to bfloat16).

    Buffers: ``packed`` uint8 ``[N, K // 2]`` (``_convert_weight_to_int4pack_for_cpu``'s layout, made once from the
    codes), ``scales_and_zeros`` bfloat16 ``[K // group_size, N, 2]`` (the kernel's layout, zeros 0), ``zeros``
    float32 ``[K // group_size, N]`` (None when all are 0, as in Q4_0). x: ``[..., K]``; returns ``[..., N]`` in
    x's dtype.

    Raises:
        ValueError: a group size the kernel lacks, K not a multiple of it, or N not a multiple of 16.
    """

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = weight.codes.shape
        if weight.group_size not in INT4_GROUP_SIZES or k % weight.group_size or n % INT4_N_MULTIPLE:
            raise ValueError(f"int4 kernel: N={n} (multiple of {INT4_N_MULTIPLE}), K={k}, group size "
                             f"{weight.group_size} (one of {INT4_GROUP_SIZES}, dividing K) not supported")
        self.in_features, self.out_features, self.group_size = k, n, weight.group_size
        self.source = weight.source
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.codes.to(torch.int32).contiguous(), 1))
        sz = torch.stack([weight.scales.t(), torch.zeros_like(weight.scales.t())], dim=-1)
        self.register_buffer("scales_and_zeros", sz.to(KERNEL_DTYPE).contiguous())
        has_zeros = bool(weight.zeros.any())
        self.register_buffer("zeros", weight.zeros.t().contiguous() if has_zeros else None)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Few ops on purpose: at one token a step runs 120 of these, and each torch op costs microseconds.
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE), self.packed, self.group_size,
                                                       self.scales_and_zeros)
        if self.zeros is not None:
            group_sums = x2.view(x2.shape[0], -1, self.group_size).sum(-1, dtype=torch.float32)
            y = torch.addmm(y.to(torch.float32), group_sums, self.zeros)
        if self.bias is not None:
            y = y + self.bias
        y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}, source={self.source}"


class Int8Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W an :class:`Int8ChannelWeight`, through ``_weight_int8pack_mm``.

    Buffers: ``codes`` int8 ``[N, K]``, ``scales`` bfloat16 ``[N]``. x: ``[..., K]``; returns ``[..., N]`` in x's dtype.
    """

    def __init__(self, weight: Int8ChannelWeight, bias: torch.Tensor | None = None, source: str = "int8"):
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.source = source
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", weight.scales.to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_to_kernel_input(x, self.in_features), self.codes, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, per-channel, source={self.source}"


class Q8Embedding(nn.Module):
    """Token embedding kept as GGUF Q8_0 blocks; the looked-up rows are dequantized exactly (float32) and cast.

    ids: int64 ``[T]``; returns ``[T, hidden]`` in ``dtype``.
    """

    def __init__(self, weight: Int8BlockWeight, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.codes.shape
        self.block_size, self.dtype = weight.block_size, dtype
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("block_scales", weight.scales.contiguous())

    def weight_blocks(self) -> Int8BlockWeight:
        return Int8BlockWeight(self.codes, self.block_scales, self.block_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_blocks().dequantize(ids).to(self.dtype)


class RescoredLMHead(nn.Module):
    """An LM head through the int8 kernel whose ``top_k`` best logits per row are recomputed exactly.

    The kernel's logits carry two errors: the weights requantized per channel (from Q8_0's per-block scales) and
    the bfloat16 output, whose rounding step is 0.125 at logits of 16-32 (measured: top-1 agreement with the fp32
    head fell to 97% on 1,000 tokens). So the ``top_k`` largest approximate logits of each row are replaced by the
    float32 product of the hidden state with the exact rows of ``exact`` (the stored Q8_0 blocks, or the int8
    weight itself); greedy choices and the sampled head of the distribution then use exact logits.

    x: ``[M, K]``; returns float32 logits ``[M, N]``.
    """

    def __init__(self, approx: Int8Linear, exact: Int8BlockWeight | Int8ChannelWeight, top_k: int = 32):
        super().__init__()
        self.approx, self.exact, self.top_k = approx, exact, top_k
        self.source = approx.source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.approx(x).to(torch.float32)
        k = min(self.top_k, logits.shape[-1])
        idx = logits.topk(k, dim=-1, sorted=False).indices                     # [M, k]
        rows = self.exact.dequantize(idx.reshape(-1)).view(*idx.shape, -1)      # [M, k, K] float32, exact
        logits.scatter_(-1, idx, torch.bmm(rows, x.to(torch.float32).unsqueeze(-1)).squeeze(-1))
        return logits

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}"
