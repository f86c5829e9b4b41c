"""Reasoning in the request pipeline (:mod:`pagedserve.serving.reasoning`), over a scripted engine: each choice
split on its own (n = 2), pieces cut inside the tags, a tool call read from the content only (a ``<tool_call>``
in the thinking is not one), the reasoning's tokens counted, ``include_reasoning: false``, and no split for a
request that does not ask for it (the completions API)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from pagedserve.outputs import CompletionDelta, Usage
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.generation import GenerateCall, GenerationService
from pagedserve.serving.metrics import ServerMetrics
from pagedserve.serving.pipeline import GenerationRequest, open_generation
from pagedserve.serving.prompts import TokenPrompt
from pagedserve.tool_calls import plan_tools

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


class Engine:
    """``generate`` replays ``pieces`` (text, number of tokens) for each completion index."""

    def __init__(self, pieces):
        self.pieces, self.tokenizer, self.vocab_size, self.num_live_requests = pieces, None, 100, 0

    async def generate(self, request_id, prompt_token_ids, params, *args, **kwargs):
        for index in range(params.n):
            for j, (text, k) in enumerate(self.pieces):
                last = j == len(self.pieces) - 1
                yield CompletionDelta(request_id, index, text, [7] * k, finish_reason="stop" if last else None,
                                      usage=Usage(3, 10, 0) if last and index == params.n - 1 else None)
                await asyncio.sleep(0)


def _run(pieces, parser="deepseek_r1", **request):
    generation = GenerationService(Engine(pieces), SimpleNamespace(name="m", max_model_len=64), ServerMetrics(),
                                   reasoning_parser=parser)
    n = request.pop("n", 1)
    call = GenerateCall(TokenPrompt((1, 2, 3)), SamplingParams(n=n, max_tokens=10), "r")

    async def go():
        stream = await open_generation(generation, GenerationRequest((call,), **request))
        try:
            return stream, [c async for c in stream]
        finally:
            await stream.close()

    return asyncio.run(go())


def _joined(choices, index, attr):
    return "".join(getattr(c, attr) or "" for c in choices if c.index == index)


PIECES = [("Think <tool", 2), ("_call> no</th", 3), ("ink>\n\n", 2), ('<tool_call>{"name": "get", "argu', 2),
          ('ments": {}}</tool_call>', 1)]


def test_each_choice_split_and_tool_calls_read_from_the_content_only():
    plan = plan_tools(TOOLS, "auto", None, "hermes")
    stream, choices = _run(PIECES, tools=plan, reasoning=True, n=2)
    for index in (0, 1):
        assert _joined(choices, index, "reasoning") == "Think <tool_call> no"
        calls = [t for c in choices if c.index == index for t in c.tool_calls]
        assert [t["function"].get("name") for t in calls if t["function"].get("name")] == ["get"]
        assert json.loads("".join(t["function"].get("arguments", "") for t in calls)) == {}
        assert [c.finish_reason for c in choices if c.index == index][-1] == "tool_calls"
    assert stream.usage.reasoning_tokens == 2 * (2 + 3 + 2)   # the pieces read in the reasoning, the end tag's too


def test_include_reasoning_false_and_no_split_unless_asked():
    stream, choices = _run(PIECES[:3], reasoning=True, include_reasoning=False)
    assert _joined(choices, 0, "reasoning") == "" and _joined(choices, 0, "content") == "\n\n"
    assert stream.usage.reasoning_tokens == 7
    stream, choices = _run(PIECES[:3])
    assert all(c.reasoning is None for c in choices) and stream.usage.reasoning_tokens == 0
    assert _joined(choices, 0, "content") == "".join(t for t, _ in PIECES[:3])


def test_qwen3_without_think_is_all_content_and_counts_nothing():
    stream, choices = _run([("Plain ", 1), ("answer", 1)], parser="qwen3", reasoning=True)
    assert all(c.reasoning is None for c in choices) and stream.usage.reasoning_tokens == 0
    assert _joined(choices, 0, "content") == "Plain answer"
