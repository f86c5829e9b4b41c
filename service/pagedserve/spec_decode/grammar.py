"""Structured output at every draft position: the grammar's next-token mask after each prefix of the drafts.

The matcher walks the drafts (each checked against the mask before it is consumed, so a draft the grammar forbids
ends the drafts there) and is rolled back to where it was, so it stays in step with the completion's verified
output tokens; the engine advances it on the tokens that verification emits, exactly as at plain steps.
"""
from __future__ import annotations

import torch


def draft_bitmasks(matcher, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
    """Trim ``drafts`` to what the grammar allows and compute the mask at each position.

    Args:
        matcher: the completion's :class:`~pagedserve.structured_output.grammar.GrammarMatcher` (left in
            the state it was given in).
        drafts: proposed token ids.

    Returns:
        ``(kept drafts, bitmask)``: the longest allowed prefix of ``drafts`` and ``[1 + len(kept), W]`` int32 on
        CPU, row ``j`` the next-token bitmask after the first ``j`` kept drafts.
    """
    bitmask = torch.zeros(len(drafts) + 1, matcher.num_words, dtype=torch.int32)
    consumed = 0
    try:
        for j in range(len(drafts) + 1):
            matcher.fill_bitmask(bitmask[j])
            if j == len(drafts) or not _allowed(bitmask[j], drafts[j]):
                break
            matcher.accept(drafts[j])
            consumed += 1
    finally:
        matcher.rollback(consumed)
    return drafts[:consumed], bitmask[:consumed + 1].clone()


def _allowed(row: torch.Tensor, token: int) -> bool:
    word = token // 32
    return word < row.shape[0] and bool((int(row[word]) >> (token % 32)) & 1)

