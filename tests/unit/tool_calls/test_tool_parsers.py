"""Tool-call parsers on scripted model output, whole and fed in fragments: the streamed deltas must reassemble
(by index, as the openai SDK does) into exactly the calls the whole-output parse gives."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.errors import InvalidInputError
from pagedserve.tool_calls import ToolCallStream, make_parser, parse_whole, plan_tools
from pagedserve.tool_calls.parsers import NamedCallParser, RequiredCallsParser
from pagedserve.tool_calls.request import NO_ARGUMENTS_SCHEMA, arguments_schema

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris \\"x\\" {}"}}\n'
          '</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ' \
        '"parameters": {}}'
EXPECTED = {"hermes": ("Let me check.", [("get_weather", {"city": "Paris", "unit": "c"}),
                                         ("get_time", {"tz": 'Europe/Paris "x" {}'})]),
            "llama3_json": (None, [("get_weather", {"city": "Paris"}), ("get_time", {})])}
TEXTS = {"hermes": HERMES, "llama3_json": LLAMA}


def _reassemble(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed pieces; join content and merge tool-call deltas by index the way the SDK's stream helpers do. Each
    feed (one chunk) holds at most one entry per call index."""
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += text
        assert len({d["index"] for d in deltas}) == len(deltas), deltas
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function"
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"],
                                     "arguments": d["function"]["arguments"]}
            else:
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def _fragments(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_whole_output(name):
    content, calls = parse_whole(make_parser(name), TEXTS[name])
    assert content == EXPECTED[name][0]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED[name][1]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("seed", range(20))
def test_streamed_fragments_reassemble_to_the_whole_parse(name, seed):
    pieces = _fragments(TEXTS[name], seed) if seed else list(TEXTS[name])  # seed 0: one character at a time
    content, calls = _reassemble(ToolCallStream(make_parser(name)), pieces)
    assert content == (EXPECTED[name][0] or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == EXPECTED[name][1]


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_plain_text_is_content(name):
    text = "The weather in Paris is mild <tool"  # a held-back possible tag start comes out at the end
    assert parse_whole(make_parser(name), text) == (text, [])
    assert _reassemble(ToolCallStream(make_parser(name)), list(text)) == (text, [])


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "arguments": {"a": 1}', '<tool_call>{"name": f}'
                                  '</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_invalid_calls_fall_back_to_content(text):
    assert parse_whole(make_parser("hermes"), text) == (text, [])


def test_a_call_whose_name_and_arguments_come_in_one_feed_is_one_entry():
    """The header carries the arguments' first fragment (vLLM's shape): one entry per index in a chunk."""
    stream = ToolCallStream(RequiredCallsParser())
    content, deltas = stream.feed('[{"name": "get_weather", "parameters": {"city": "Os')
    assert content == "" and len(deltas) == 1
    assert deltas[0]["index"] == 0 and deltas[0]["id"].startswith("chatcmpl-tool-")
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Os'}
    _, deltas = stream.feed('lo"}}, {"name": "get_time", "parameters": {"tz": "UTC"}}]', final=True)
    assert [d["index"] for d in deltas] == [0, 1]
    assert deltas[0] == {"index": 0, "function": {"arguments": 'lo"}'}}
    assert deltas[1]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'} and "id" in deltas[1]


def test_named_and_required_outputs():
    args = '{"city":"Oslo","days":[1,2]}'
    content, calls = _reassemble(ToolCallStream(NamedCallParser("get_weather")), _fragments(args, 3))
    assert (content, calls[0]["name"], calls[0]["arguments"]) == ("", "get_weather", args)
    required = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'
    content, calls = _reassemble(ToolCallStream(RequiredCallsParser()), _fragments(required, 4))
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")]
    assert [c["function"]["name"] for c in parse_whole(RequiredCallsParser(), required)[1]] == \
        ["get_weather", "get_time"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]


def test_plan_schemas_and_modes():
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.mode == "named" and named.schema == TOOLS[0]["function"]["parameters"]
    required = plan_tools(TOOLS, "required", False, None)
    assert required.schema["type"] == "array" and required.schema["minItems"] == 1
    assert required.schema["maxItems"] == 1
    assert [b["properties"]["name"]["const"] for b in required.schema["items"]["anyOf"]] == ["get_weather",
                                                                                           "get_time"]
    assert "maxItems" not in plan_tools(TOOLS, "required", None, None).schema
    assert required.schema["items"]["anyOf"][1]["properties"]["parameters"] == NO_ARGUMENTS_SCHEMA
    assert plan_tools(TOOLS, "none", None, None).schema is None
    assert plan_tools(TOOLS, None, None, "hermes").mode == "auto"
    assert plan_tools(None, None, None, None) is None


@pytest.mark.parametrize("parameters", [None, {}, {"type": "object"}, {"type": "object", "properties": {}},
                                        {"properties": {}, "title": "NoArgs", "type": "object", "required": []}])
def test_a_function_without_parameters_is_called_with_an_empty_object(parameters):
    fn = {"name": "ping"} if parameters is None else {"name": "ping", "parameters": parameters}
    plan = plan_tools([{"type": "function", "function": fn}], {"type": "function", "function": {"name": "ping"}},
                      None, None)
    assert plan.schema == NO_ARGUMENTS_SCHEMA == {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("parameters", [{"type": "object", "additionalProperties": True},
                                        {"type": "object", "additionalProperties": {"type": "string"}},
                                        {"type": "object", "properties": {"x": {"type": "integer"}}},
                                        {"type": "object", "patternProperties": {"^x": {}}}])
def test_a_schema_that_says_which_properties_it_allows_is_kept(parameters):
    assert arguments_schema(parameters) == parameters


@pytest.mark.parametrize("tools,choice,field,match", [
    (TOOLS, "auto", "tool_choice", "--enable-auto-tool-choice"),
    (TOOLS, None, "tool_choice", "--enable-auto-tool-choice"),
    (None, "required", "tool_choice", "needs `tools`"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not in tools"),
    (TOOLS, "sometimes", "tool_choice", "must be"),
    ([TOOLS[0], TOOLS[0]], "required", "tools[1].function.name", "unique"),
    ([{"type": "function"}], "required", "tools[0]", "function"),
])
def test_plan_errors_name_the_body_field(tools, choice, field, match):
    with pytest.raises(InvalidInputError, match=match) as info:
        plan_tools(tools, choice, None, None)
    assert info.value.field == field


def test_config_parser_choices_are_the_registered_parsers():
    from pagedserve.config import TOOL_CALL_PARSERS
    from pagedserve.tool_calls import PARSERS

    assert TOOL_CALL_PARSERS == tuple(PARSERS)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_parser("nope")


def test_without_parallel_calls_only_the_first_is_reported():
    plan = plan_tools(TOOLS, "auto", False, "hermes")
    assert plan.max_calls == 1 and plan_tools(TOOLS, "auto", None, "hermes").max_calls is None
    content, calls = parse_whole(plan.parser(), HERMES, plan.max_calls)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]
    content, streamed = _reassemble(ToolCallStream(plan.parser(), plan.max_calls), _fragments(HERMES, 5))
    assert [c["name"] for c in streamed] == ["get_weather"]
