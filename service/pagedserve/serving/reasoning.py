"""Reasoning in the request pipeline (``--reasoning-parser``, chat requests): each choice's text split into
reasoning and content as it streams (:class:`~pagedserve.reasoning.ReasoningSplitter`, one per choice, started
from the end of its prompt), and the tokens of the reasoning counted for ``usage``.

Semantics: vLLM's reasoning parsers and OpenAI-compatible servers' ``reasoning_content`` (vLLM, SGLang). Tool
calls are read from the content part only (the pipeline feeds the tool parser what comes out here).
"""
from __future__ import annotations

from ..reasoning import Parser, ReasoningSplitter


class StreamedReasoning:
    """The choices of one request through a reasoning parser.

    Args:
        parser: the server's format.
        prompt_tails: per prompt index, the end of its rendered prompt's text.
        include: False drops the reasoning text (``include_reasoning: false``); it is still counted.
    """

    def __init__(self, parser: Parser, prompt_tails: list[str], include: bool = True):
        self.parser, self.prompt_tails, self.include = parser, prompt_tails, include
        self._splitters: dict[int, ReasoningSplitter] = {}
        self.reasoning_tokens = 0

    def feed(self, index: int, prompt_index: int, text: str, num_tokens: int, final: bool) -> tuple[str, str | None]:
        """``(content, reasoning)`` of choice ``index``'s next ``text`` (``num_tokens`` new tokens; ``final`` on
        its last delta). ``reasoning`` is None when this piece was not read in a reasoning state (a choice that
        never reasons, or past its reasoning), else the reasoning text it settled ("" when held back or dropped).
        Its tokens count as reasoning tokens when any of it was read in a reasoning state (the end tag's too)."""
        splitter = self._splitters.get(index)
        if splitter is None:
            splitter = self._splitters[index] = self.parser.splitter(self.prompt_tails[prompt_index])
        was_reasoning = splitter.in_reasoning
        out = splitter.feed(text, final=final)
        if not (out.touched_reasoning or was_reasoning):
            return out.content, None
        self.reasoning_tokens += num_tokens
        return out.content, out.reasoning if self.include else ""


def prompt_tail(tokenizer, prompt_ids: list[int], num_tokens: int = 16) -> str:
    """The text of the last ``num_tokens`` prompt tokens (special tokens kept: a template's tags may be ones)."""
    if tokenizer is None or not prompt_ids:
        return ""
    return tokenizer.decode(list(prompt_ids[-num_tokens:]))
