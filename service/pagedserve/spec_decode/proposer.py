"""Draft proposers. A proposer sees a request's tokens (prompt + output) and guesses what follows.

The engine calls :meth:`Proposer.propose` once per step for the requests that are decoding (every known token but
the last already computed), with how many drafts each may take; whatever it returns is verified by the target
model, so a proposer can be wrong without changing the output, only the speed.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..config import SpeculativeConfig


class Proposer(Protocol):
    """Anything that guesses the next tokens of a batch of requests (n-gram lookup now; a draft model later)."""

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int]) -> list[list[int]]:
        """Drafts for each request.

        Args:
            contexts: each request's token ids so far (prompt + output; the last one not yet computed).
            max_drafts: at most this many drafts for each request (>= 0).

        Returns:
            One list of draft token ids per request, each at most its ``max_drafts`` long (possibly empty).
        """
        ...


class NgramProposer:
    """Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method): find the context's
    last ``n`` tokens earlier in the context and propose the tokens that followed them.

    The longest matching suffix wins, ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``; among
    occurrences of that length the most recent one (the latest text is the likeliest to be continued). Matches may
    overlap the suffix itself (a run like ``a a a`` proposes more ``a``). Vectorized with numpy: one pass over the
    context per extra token of match length.

    Args:
        num_speculative_tokens: drafts per request at most.
        prompt_lookup_max: longest n-gram looked up (>= prompt_lookup_min).
        prompt_lookup_min: shortest n-gram that may propose (>= 1).

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int = 1):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max or num_speculative_tokens < 1:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max}) and num_speculative_tokens ({num_speculative_tokens}) >= 1")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(c, min(m, self.num_speculative_tokens)) for c, m in zip(contexts, max_drafts)]

    def propose_one(self, context: Sequence[int], max_drafts: int) -> list[int]:
        """Drafts for one context (see the class docstring); ``[]`` when no suffix of at least
        ``prompt_lookup_min`` tokens occurs earlier, or ``max_drafts <= 0``."""
        n = len(context)
        if max_drafts <= 0 or n < self.prompt_lookup_min + 1:
            return []
        tokens = np.asarray(context, dtype=np.int64)
        # ends: positions e < n - 1 where tokens[e - length + 1 .. e] equals the context's last `length` tokens
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        length, best_end, best_len = 1, -1, 0
        longest = min(self.prompt_lookup_max, n - 1)
        while ends.size:
            best_end, best_len = int(ends[-1]), length
            if length == longest:
                break
            ends = ends[ends >= length]                       # room for one more token before the match
            ends = ends[tokens[ends - length] == tokens[n - 1 - length]]
            length += 1
        if best_len < self.prompt_lookup_min:
            return []
        return tokens[best_end + 1:best_end + 1 + max_drafts].tolist()


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer ``config.method`` names. Raises ValueError for an unknown method."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    raise ValueError(f"speculative_config: unknown method {config.method!r}")
