"""The engine's side of reasoning + structured output (:class:`pagedserve.reasoning.gate.ReasoningGate`): every
token is allowed while the completion reasons, the grammar takes over from the token after the end tag (even one
cut across tokens), and a draft rollback across the end tag puts the reasoning back."""
from __future__ import annotations

import torch

from pagedserve.reasoning import get_parser
from pagedserve.reasoning.gate import ReasoningGate, TokenTexts

VOCAB = ["a", " b", "</", "think", ">", "{", "}", "<think>", "x"]


class Tok:
    def __len__(self):
        return len(VOCAB)

    def decode(self, ids):
        return "".join(VOCAB[i] for i in ids)


class FakeGrammar:
    """A grammar allowing only '{' then '}'; counts what it accepted."""

    num_words = 1

    def __init__(self):
        self.accepted: list[int] = []

    @property
    def num_tokens(self):
        return len(self.accepted)

    def fill_bitmask(self, row):
        row[0] = 1 << (5 if not self.accepted else 6)

    def accept(self, t):
        assert t == (5 if not self.accepted else 6), t
        self.accepted.append(t)

    def is_terminated(self):
        return len(self.accepted) == 2

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n:]


def _mask(gate) -> int:
    row = torch.zeros(1, dtype=torch.int32)
    gate.fill_bitmask(row)
    return int(row[0]) & 0xFFFFFFFF


def test_free_while_reasoning_then_the_grammar_after_a_split_end_tag():
    inner = FakeGrammar()
    gate = ReasoningGate(inner, get_parser("deepseek_r1"), "<think>\n", TokenTexts(Tok()))
    assert _mask(gate) == (1 << len(VOCAB)) - 1 and not gate.reasoning_ended
    for t in (0, 1, 2, 3):          # "a b</think" : the tag is not complete yet
        gate.accept(t)
        assert not gate.reasoning_ended and not gate.is_terminated()
    gate.accept(4)                  # ">" completes "</think>"
    assert gate.reasoning_ended and inner.accepted == [] and _mask(gate) == 1 << 5
    gate.accept(5)
    gate.accept(6)
    assert inner.accepted == [5, 6] and gate.is_terminated() and gate.num_tokens == 7


def test_rollback_across_the_end_tag_restores_the_reasoning():
    inner = FakeGrammar()
    gate = ReasoningGate(inner, get_parser("deepseek_r1"), "<think>", TokenTexts(Tok()))
    for t in (0, 2, 3, 4, 5):
        gate.accept(t)
    gate.rollback(3)                # back before "think>": reasoning again, grammar untouched
    assert not gate.reasoning_ended and inner.accepted == [] and gate.num_tokens == 2
    assert _mask(gate) == (1 << len(VOCAB)) - 1
    gate.accept(3)
    gate.accept(4)
    assert gate.reasoning_ended and _mask(gate) == 1 << 5


def test_prompt_that_closed_the_reasoning_constrains_from_the_first_token():
    gate = ReasoningGate(FakeGrammar(), get_parser("qwen3"), "<think>\n\n</think>\n\n", TokenTexts(Tok()))
    assert gate.reasoning_ended and _mask(gate) == 1 << 5
    qwen = ReasoningGate(FakeGrammar(), get_parser("qwen3"), "assistant\n", TokenTexts(Tok()))
    assert not qwen.reasoning_ended      # may still open <think>: waits for the end tag, as vLLM
    qwen.accept(7)
    qwen.accept(0)
    assert not qwen.reasoning_ended
