"""The request pipeline both APIs call (:mod:`pagedserve.serving.pipeline`), over a scripted engine: tool
constraints, streamed tool calls and their finish reason, choice indices and usage over several prompts, admission
errors before the first delta, and an abort when the consumer leaves."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pagedserve.errors import InvalidInputError, QueueFullError
from pagedserve.outputs import CompletionDelta, Usage
from pagedserve.sampling_params import SamplingParams, StructuredOutput
from pagedserve.serving.caller_errors import FieldNames
from pagedserve.serving.generation import GenerateCall, GenerationService
from pagedserve.serving.metrics import ServerMetrics
from pagedserve.serving.pipeline import GenerationRequest, open_generation
from pagedserve.serving.prompts import TokenPrompt
from pagedserve.tool_calls import plan_tools

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


class ScriptedEngine:
    """AsyncEngine's ``generate`` over a script: ``script(request_id, params)`` -> deltas (an exception is raised
    where it stands). Records each request's params and whether its stream was closed."""

    def __init__(self, script):
        self.script = script
        self.tokenizer = None
        self.vocab_size = 100
        self.num_live_requests = 0
        self.params: dict[str, SamplingParams] = {}
        self.closed: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None, deadline=None, caller="", timings=None):
        self.params[request_id] = params
        try:
            for item in self.script(request_id, params):
                await asyncio.sleep(0)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed.append(request_id)


def _service(script) -> GenerationService:
    info = SimpleNamespace(name="m", max_model_len=64)
    return GenerationService(ScriptedEngine(script), info, ServerMetrics())


def _call(request_id: str, **params) -> GenerateCall:
    return GenerateCall(TokenPrompt((1, 2, 3)), SamplingParams(**params), request_id)


def _done(request_id: str, index: int, text: str = "", usage: Usage | None = None) -> CompletionDelta:
    return CompletionDelta(request_id, index, text, [7], finish_reason="stop", usage=usage)


async def _choices(generation, request):
    stream = await open_generation(generation, request)
    try:
        return stream, [c async for c in stream]
    finally:
        await stream.close()


def test_a_required_tool_choice_constrains_the_output_and_streams_its_calls():
    pieces = ['[{"name": "get", ', '"parameters": {"a": 1}}]']

    def script(rid, params):
        yield CompletionDelta(rid, 0, pieces[0], [5])
        yield _done(rid, 0, pieces[1], Usage(3, 2, 0))

    generation = _service(script)
    plan = plan_tools(TOOLS, "required", None, None)
    _, choices = asyncio.run(_choices(generation, GenerationRequest((_call("r"),), plan)))
    assert generation.engine.params["r"].structured_output == StructuredOutput(json_schema=plan.schema)
    calls = [c for choice in choices for c in choice.tool_calls]
    assert calls[0]["function"]["name"] == "get"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 1}
    assert all(choice.content == "" for choice in choices)
    assert [choice.finish_reason for choice in choices] == [None, "tool_calls"]


def test_a_tool_constraint_next_to_another_names_the_callers_field():
    plan = plan_tools(TOOLS, "required", None, None)
    call = _call("r", structured_output={"regex": "a+"})
    for fields, named in ((FieldNames(), "sampling.structured_output"),
                          (FieldNames(prefix="sampling.", constraint="response_format"), "response_format")):
        with pytest.raises(InvalidInputError, match=f"combined with {named}") as info:
            asyncio.run(_choices(_service(lambda rid, p: ()), GenerationRequest((call,), plan, fields)))
        assert info.value.field == "tool_choice"


def test_several_prompts_merge_with_choice_indices_and_summed_usage():
    def script(rid, params):
        yield CompletionDelta(rid, 1, "x", [5])
        yield _done(rid, 1)
        yield _done(rid, 0, usage=Usage(3, 4, 1))

    request = GenerationRequest((_call("a", n=2), _call("b", n=2)))
    stream, choices = asyncio.run(_choices(_service(script), request))
    assert sorted((c.index, c.prompt_index) for c in choices if c.finish_reason) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert (stream.usage.prompt_tokens, stream.usage.completion_tokens, stream.usage.cached_prompt_tokens) == (6, 8, 2)
    assert all(c.content == c.delta.text and c.tool_calls == [] for c in choices)


def test_an_admission_error_is_raised_before_the_first_delta():
    generation = _service(lambda rid, params: [QueueFullError("the waiting queue is full")])
    with pytest.raises(QueueFullError):
        asyncio.run(open_generation(generation, GenerationRequest((_call("r"),))))
    assert generation.engine.closed == ["r"]


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_leaving_early_closes_every_engine_stream(num_prompts):
    def script(rid, params):
        while True:
            yield CompletionDelta(rid, 0, "x", [5])

    generation = _service(script)

    async def run():
        stream = await open_generation(generation, GenerationRequest(tuple(_call(f"r{i}")
                                                                           for i in range(num_prompts))))
        async for _ in stream:
            break
        await stream.close()

    asyncio.run(run())
    assert sorted(generation.engine.closed) == [f"r{i}" for i in range(num_prompts)]
