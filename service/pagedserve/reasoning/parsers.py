"""The ``--reasoning-parser`` formats (vLLM's names and semantics, ``vllm/reasoning/``; written for pagedserve):

- ``deepseek_r1``: the text up to ``</think>`` is reasoning, the rest content. The ``<think>`` start may be in the
  prompt (the chat template emitted it) or generated (dropped); with no ``</think>`` at all, everything is
  reasoning. A prompt that already ends with ``</think>`` (thinking switched off by the template) starts in
  content.
- ``qwen3``: ``<think>...</think>`` as the first thing generated is reasoning; when no ``<think>`` comes first,
  everything is content (``enable_thinking: false``). A prompt ending with ``<think>`` (Qwen3 thinking templates)
  starts in the reasoning; one ending with ``</think>`` starts in content. Reasoning cut by ``max_tokens`` before
  ``</think>`` stays reasoning.
- ``gpt_oss``: OpenAI harmony channels: ``<|channel|>analysis<|message|>...<|end|>`` is reasoning,
  ``<|channel|>final<|message|>...`` (and ``commentary``) content; headers and ``<|start|>assistant`` markup are
  dropped. The tags are read as text (whatever tokens produce them). A prompt ending with a channel header starts
  in that channel.
"""
from __future__ import annotations

from .splitter import CAPTURE, CONTENT, DROP, REASONING, Parser, State

THINK_START, THINK_END = "<think>", "</think>"


class DeepSeekR1Parser(Parser):
    """vLLM's ``deepseek_r1`` (DeepSeekR1ReasoningParser semantics)."""

    name = "deepseek_r1"
    states = {
        "reasoning": State(REASONING, ((THINK_START, "reasoning"), (THINK_END, "content"))),
        "content": State(CONTENT),
    }

    def start_state(self, prompt_tail: str) -> str:
        return "content" if prompt_tail.rstrip().endswith(THINK_END) else "reasoning"


class Qwen3Parser(Parser):
    """vLLM's ``qwen3`` (Qwen3ReasoningParser semantics)."""

    name = "qwen3"
    states = {
        "opening": State(CONTENT, ((THINK_START, "reasoning"),), leading=True, otherwise="content"),
        "reasoning": State(REASONING, ((THINK_END, "content"),)),
        "content": State(CONTENT),
    }

    def start_state(self, prompt_tail: str) -> str:
        tail = prompt_tail.rstrip()
        if tail.endswith(THINK_END):
            return "content"
        return "reasoning" if tail.endswith(THINK_START) else "opening"


_CHANNEL, _MESSAGE = "<|channel|>", "<|message|>"
_MESSAGE_ENDS = tuple((m, "between") for m in ("<|end|>", "<|return|>", "<|call|>", "<|start|>"))


class GptOssParser(Parser):
    """vLLM's ``gpt_oss`` (harmony channels read as text)."""

    name = "gpt_oss"
    states = {
        "between": State(DROP, ((_CHANNEL, "header"),)),
        "header": State(CAPTURE, ((_MESSAGE, ""),)),
        "analysis": State(REASONING, _MESSAGE_ENDS),
        "final": State(CONTENT, _MESSAGE_ENDS),
    }

    def start_state(self, prompt_tail: str) -> str:
        tail = prompt_tail.rstrip()
        if tail.endswith(_MESSAGE):
            head = tail[:-len(_MESSAGE)]
            at = head.rfind(_CHANNEL)
            if at >= 0 and _MESSAGE not in head[at:]:
                return self.after_capture(head[at + len(_CHANNEL):], _MESSAGE)
        if tail.endswith(_CHANNEL):
            return "header"
        return "between"

    def after_capture(self, captured: str, marker: str) -> str:
        words = captured.split()
        return "analysis" if words and words[0] == "analysis" else "final"


PARSERS: dict[str, type[Parser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, GptOssParser)}
"""``--reasoning-parser`` names -> parser classes (config.REASONING_PARSERS lists the same names)."""


def get_parser(name: str) -> Parser:
    """The parser named ``name``. Raises ValueError for an unknown name, listing the known ones."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(PARSERS)}") from None
