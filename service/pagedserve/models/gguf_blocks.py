"""GGUF quantized blocks to :mod:`.quant` weights, without a round trip through floats.

Block layouts (ggml's ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``, the GGUF spec; ``gguf.quants`` dequantizes them
the same way), 32 weights along K per block, a row of a ``[N, K]`` tensor being ``K // 32`` consecutive blocks:

- Q4_0, 18 bytes: ``d`` (float16), 16 bytes of nibbles; weight ``j < 16`` is the low nibble of byte ``j``, weight
  ``j + 16`` its high nibble; ``w = d * (q - 8)``.
- Q4_1, 20 bytes: ``d``, ``m`` (float16), 16 bytes of nibbles as in Q4_0; ``w = d * q + m``.
- Q8_0, 34 bytes: ``d`` (float16), 32 int8 ``q``; ``w = d * q``.
"""
from __future__ import annotations

import numpy as np
import torch

from .quant import Int4Weight, Int8BlockWeight

BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
KEPT_TYPES = frozenset(_BLOCK_BYTES)


class InexactRepackError(ValueError):
    """A Q4_1 block whose ``m + 8 d`` is not exact in float32 (the int4 zero would round)."""


def _blocks(data: np.ndarray, shape: tuple[int, int], type_name: str) -> torch.Tensor:
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"{type_name}: K={k} is not a multiple of {BLOCK}")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
    return raw.reshape(n, k // BLOCK, _BLOCK_BYTES[type_name])


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` little-endian bytes -> ``[...]`` float16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[N, G, 16]`` uint8 -> codes ``[N, G * 32]`` uint8 (low nibbles first, then high nibbles, per block)."""
    n, g, _ = qs.shape
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, g * BLOCK)


def gguf_to_quant(data: np.ndarray, shape: tuple[int, int], type_name: str) -> Int4Weight | Int8BlockWeight:
    """The weight of a GGUF tensor ``[N, K]`` (HF order: N output rows) of type Q4_0, Q4_1 or Q8_0.

    data: the tensor's bytes as ``gguf.GGUFReader`` gives them (uint8, ``[N, K // 32 * block_bytes]``).

    Raises:
        ValueError: an unsupported type or K not a multiple of 32.
        InexactRepackError: a Q4_1 zero ``m + 8 d`` that float32 cannot hold exactly.
    """
    if type_name not in KEPT_TYPES:
        raise ValueError(f"no quantized form for GGUF type {type_name}")
    b = _blocks(data, shape, type_name)
    d = _f16(b[..., 0:2]).to(torch.float32)
    if type_name == "Q8_0":
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(shape)
        return Int8BlockWeight(codes, _f16(b[..., 0:2]).contiguous())
    if type_name == "Q4_0":
        return Int4Weight(_nibbles(b[..., 2:]), d, torch.zeros_like(d), BLOCK, type_name)
    m = _f16(b[..., 2:4]).to(torch.float32)
    zeros = m + 8 * d
    if not torch.equal(zeros.double() - 8 * d.double(), m.double()):
        raise InexactRepackError("Q4_1 block zero m + 8d is not exact in float32")
    return Int4Weight(_nibbles(b[..., 4:]), d, zeros, BLOCK, type_name)
