"""Step 0 of the sampler: structured output's grammar masks on the logits."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...structured_output.bitmask import apply_bitmask_

if TYPE_CHECKING:
    from ..sampler import SamplingRow


def apply_grammars(raw: torch.Tensor, rows: list["SamplingRow"], constrained: list[int]) -> torch.Tensor:
    """Step 0: a copy of ``raw`` ``[B, V]`` with ``-inf`` where the grammar of a row in ``constrained`` (row
    indices whose ``grammar`` is set) does not allow the token; columns past the tokenizer's vocabulary are
    never allowed. The bitmasks are computed here, from the matchers' current state."""
    from pagedserve.structured_output.grammar import fill_bitmasks  # the grammar library, when used

    bitmask = fill_bitmasks([rows[i].grammar for i in constrained])
    logits = raw.clone()
    if len(constrained) == len(rows):
        apply_bitmask_(logits, bitmask)
    else:
        idx = torch.tensor(constrained, device=raw.device)
        part = logits[idx]
        apply_bitmask_(part, bitmask)
        logits[idx] = part
    return logits


def keep_some_allowed(processed: torch.Tensor, masked: torch.Tensor, constrained: list[int]) -> None:
    """Constrained rows that steps 2-5 left with no finite logit (``min_tokens`` masking the only allowed stop
    token) take back their masked logits, so the grammar still holds."""
    idx = torch.tensor(constrained, device=processed.device)
    dead = idx[processed[idx].amax(dim=-1).isneginf()]
    if dead.numel():
        processed[dead] = masked[dead]


class MaskRow:
    """A precomputed bitmask row that stands in for a matcher in :func:`~pagedserve.structured_output.grammar.
    fill_bitmasks` (it copies the row instead of asking a grammar): the worker's rows carry the step's
    ``grammar_bitmask`` rows this way."""

    __slots__ = ("row", "num_words")

    def __init__(self, row: torch.Tensor):
        self.row = row              # [W] int32 CPU
        self.num_words = row.shape[0]

    def fill_bitmask(self, out: torch.Tensor) -> None:
        out.copy_(self.row)
