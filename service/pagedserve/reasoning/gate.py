"""Structured output after the reasoning (vLLM's reasoning + structured outputs: the grammar advances only once
the reasoning has ended): a matcher that lets every token through while the completion is still reasoning, then
hands over to the request's grammar matcher from the first token after the end tag.

The reasoning's end is read on text, with the same :class:`~.splitter.ReasoningSplitter` the request pipeline
uses, fed each accepted token's text; the gate stands in for the
:class:`~pagedserve.structured_output.grammar.GrammarMatcher` wherever the engine uses one (masks, accept,
termination, draft rollback).
"""
from __future__ import annotations

import torch

from ..config_speculative import MAX_SPECULATIVE_TOKENS
from .splitter import Parser, ReasoningSplitter

_KEPT = MAX_SPECULATIVE_TOKENS + 1   # splitter snapshots kept: a rollback never goes back further (drafts)


class TokenTexts:
    """Token id -> its text alone (``tokenizer.decode([id])``), cached; shared by a model's gates."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._every: torch.Tensor | None = None

    def every_token(self, num_words: int) -> torch.Tensor:
        """A ``[num_words]`` int32 mask row allowing each of the tokenizer's tokens (none past its vocabulary)."""
        if self._every is None or self._every.shape[0] != num_words:
            bits = torch.zeros(num_words * 32, dtype=torch.bool)
            bits[:min(len(self._tokenizer), num_words * 32)] = True
            weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
            words = (bits.view(num_words, 32).long() * weights).sum(dim=1)
            self._every = words.to(torch.int32)
        return self._every

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


class ReasoningGate:
    """A completion's grammar matcher behind its reasoning (the engine thread owns it).

    Args:
        inner: the completion's grammar matcher (fresh: nothing accepted).
        parser: the server's reasoning format.
        prompt_tail: the end of the prompt's text (a template may have opened or closed the reasoning).
        texts: token id -> text.
    """

    __slots__ = ("inner", "num_words", "num_tokens", "_parser", "_prompt_tail", "_texts", "_splitter", "_free",
                 "_ended")

    def __init__(self, inner, parser: Parser, prompt_tail: str, texts: TokenTexts):
        self.inner, self.num_words = inner, inner.num_words
        self._parser, self._prompt_tail, self._texts = parser, prompt_tail, texts
        self.num_tokens = 0
        self._free: list[tuple] = []   # per token accepted while reasoning: the splitter before it
        self._splitter: ReasoningSplitter = parser.splitter(prompt_tail)
        self._ended = self._splitter.reasoning_ended

    @property
    def reasoning_ended(self) -> bool:
        """The grammar is in charge (tokens from now on are constrained)."""
        return self._ended

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """The next-token mask into ``row``: every token while reasoning, else the grammar's."""
        if self._ended:
            self.inner.fill_bitmask(row)
        else:
            row.copy_(self._texts.every_token(self.num_words))

    def accept(self, token_id: int) -> None:
        """Advance on a sampled token. Raises RuntimeError when the grammar rejects it (a bug)."""
        if self._ended:
            self.inner.accept(token_id)
        else:
            self._free.append(self._splitter.snapshot())
            if len(self._free) > 2 * _KEPT:
                del self._free[:-_KEPT]
            self._splitter.feed(self._texts(token_id))
            self._ended = self._splitter.reasoning_ended
        self.num_tokens += 1

    def is_terminated(self) -> bool:
        """True when the grammar has ended (never while reasoning)."""
        return self._ended and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (drafts, at most ``MAX_SPECULATIVE_TOKENS``); the splitter
        goes back to where it was before the first reasoning token forgotten. Raises RuntimeError when the grammar
        cannot roll back, or further back than the snapshots kept."""
        if not num_tokens:
            return
        grammar_n = min(num_tokens, self.inner.num_tokens)
        self.inner.rollback(grammar_n)
        rest = num_tokens - grammar_n
        if rest:
            if rest > len(self._free):
                raise RuntimeError(f"reasoning rollback of {rest} tokens: only {len(self._free)} kept")
            self._splitter.restore(self._free[-rest])
            del self._free[-rest:]
            self._ended = self._splitter.reasoning_ended
        self.num_tokens -= num_tokens
