"""Token bitmasks -> logits: one bit per token, 32 tokens per int32 word, bit ``t % 32`` of word ``t // 32``
(little-endian bit order, as the grammar library writes them). Pure torch / numpy; no grammar library here.
"""
from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def bitmask_words(num_tokens: int) -> int:
    """int32 words per row for ``num_tokens`` tokens: ``ceil(num_tokens / 32)``."""
    return (num_tokens + 31) // 32


def unpack_allowed(bitmask: torch.Tensor, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Allowed tokens as bools, sized to the logits.

    Args:
        bitmask: ``[n, W]`` int32 on CPU, contiguous.
        width: the logits width ``V``; columns at or past ``32 * W`` are not allowed (the model's vocabulary may be
            wider than the tokenizer's).
        device: where the result goes; on CPU the bits are unpacked by numpy (vectorized), elsewhere the packed
            words are copied over and unpacked there with shifts.

    Returns:
        ``[n, V]`` bool, True where the token is allowed.
    """
    n, words = bitmask.shape
    device = torch.device(device)
    covered = min(width, 32 * words)
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=covered, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:
        packed = bitmask.to(device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :covered].bool()
    if covered < width:
        allowed = torch.cat([allowed, allowed.new_zeros(n, width - covered)], dim=1)
    return allowed


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    Args:
        logits: ``[n, V]`` float (any device).
        bitmask: ``[n, W]`` int32 on CPU (see :func:`unpack_allowed`).

    Returns:
        ``[n, V]`` bool on the logits' device, True where a token is NOT allowed.

    Raises:
        ValueError: the row counts differ, or the bitmask is not int32.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or logits.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} does not fit logits {tuple(logits.shape)}")
    disallowed = unpack_allowed(bitmask, logits.shape[1], logits.device).logical_not_()
    logits.masked_fill_(disallowed, _NEG_INF)
    return disallowed
