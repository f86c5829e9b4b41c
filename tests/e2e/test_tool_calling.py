"""Tool calling through the openai SDK and LangChain against the session server (SmolLM2, no auto parser):
``tool_choice`` named and ``required`` are enforced by structured output, so every sampled call is a listed
function whose arguments validate against its schema, streamed or not; a full agent turn; the SDK's ``parse``."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest
from support import TIME, TOOLS, WEATHER

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
NUM_SAMPLES = 20


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def _streamed_calls(stream) -> tuple[list[dict], str | None]:
    """Tool calls reassembled from chunks the way the SDK's stream helpers do (by index), and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish


def _sample(oai, tool_choice, stream: bool, seed: int) -> tuple[list[dict], str | None]:
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=64, temperature=1.0, seed=seed)
    if stream:
        return _streamed_calls(oai.chat.completions.create(stream=True, **kw))
    choice = oai.chat.completions.create(**kw).choices[0]
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []], choice.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_sampled_calls_are_valid_calls_of_listed_functions(oai, tool_choice, stream):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda seed: _sample(oai, tool_choice, stream, seed), range(NUM_SAMPLES)))
    distinct = set()
    for calls, finish in results:
        assert finish == "tool_calls" and len(calls) == 1, (calls, finish)
        call = calls[0]
        assert call["id"].startswith("chatcmpl-tool-") and call["name"] in SCHEMAS
        if tool_choice is NAMED:
            assert call["name"] == "get_weather"
        args = json.loads(call["arguments"])
        jsonschema.validate(args, SCHEMAS[call["name"]])
        distinct.add(call["arguments"])
    assert len(distinct) > 1, "temperature 1 with different seeds should not give one answer"


def test_required_with_parallel_calls_allows_several_calls(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                    max_tokens=160, temperature=0)
    choice = r.choices[0]
    assert choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_call_cut_by_max_tokens_finishes_with_length(oai, tool_choice, stream):
    calls, finish = _cut(oai, tool_choice, stream)
    assert finish == "length", (calls, finish)


def _cut(oai, tool_choice, stream: bool) -> tuple[list[dict], str | None]:
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=3, temperature=0)
    if stream:
        return _streamed_calls(oai.chat.completions.create(stream=True, **kw))
    choice = oai.chat.completions.create(**kw).choices[0]
    return [c.model_dump() for c in choice.message.tool_calls or []], choice.finish_reason


def test_streamed_required_call_sends_no_empty_delta_chunks(server):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 64,
            "temperature": 0, "parallel_tool_calls": False, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    choices = [c for chunk in chunks for c in chunk["choices"]]
    empty = [c for c in choices if not c["delta"] and c["finish_reason"] is None]
    assert not empty, f"{len(empty)} chunks with an empty delta and no finish_reason"
    assert any(c["delta"].get("tool_calls") for c in choices)
    assert choices[-1]["finish_reason"] == "tool_calls" and "usage" in chunks[-1]


def _sse_chunks(server, body: dict) -> list[dict]:
    """The JSON chunks of a streamed chat request, as sent (before any SDK merges them)."""
    chunks = []
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_streamed_named_call_sends_one_entry_per_index_and_the_sdk_sees_one_call(server, oai):
    """The first tool-call chunk carries the name with the first argument fragment in one entry (an SDK that takes
    a chunk's entries as calls would otherwise see a phantom second call)."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 64,
            "temperature": 0}
    whole = oai.chat.completions.create(**body).choices[0].message.tool_calls
    entries = [c["delta"].get("tool_calls") or [] for chunk in _sse_chunks(server, body) for c in chunk["choices"]]
    entries = [e for e in entries if e]
    assert all(len({d["index"] for d in e}) == len(e) for e in entries), entries
    first = entries[0][0]
    assert first["index"] == 0 and first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather" and first["function"]["arguments"]
    assert all(d["index"] == 0 and "id" not in d for e in entries[1:] for d in e)
    joined = "".join(d["function"]["arguments"] for e in entries for d in e)
    assert joined == whole[0].function.arguments
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    with oai.chat.completions.stream(**{**body, "tools": strict}) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == whole[0].function.arguments
    assert calls[0].function.parsed_arguments == json.loads(whole[0].function.arguments)


PING = {"type": "function", "function": {"name": "ping", "description": "Check the service is up"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "ping"}}, "required"],
                         ids=["named", "required"])
def test_a_tool_without_parameters_is_called_with_empty_arguments(oai, tool_choice, stream):
    """No ``parameters`` means no arguments: exactly ``{}`` (a free object schema let the model invent fields)."""
    for seed in range(4):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Is the service up? Tell me the weather."}],
                  tools=[PING], tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=48, temperature=1.0,
                  seed=seed)
        if stream:
            calls, finish = _streamed_calls(oai.chat.completions.create(stream=True, **kw))
        else:
            choice = oai.chat.completions.create(**kw).choices[0]
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
            finish = choice.finish_reason
        assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [("ping", "{}")], seed


def test_tool_choice_none_answers_in_text(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8,
                                    temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS}, "tool_choice"),                       # auto by default, and this server has no parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(oai, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **body)
    assert info.value.body["param"] == param
    if body.get("tool_choice", "auto") == "auto" and "tools" in body:
        assert "--enable-auto-tool-choice" in info.value.body["message"]


def test_full_agent_turn_call_then_tool_result_then_answer(oai, tokenizer):
    first = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                        max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    result = json.dumps({"temperature": 18, "unit": "c"})
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    # the tool result reached the prompt through the chat template
    without = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens >= without.usage.prompt_tokens + len(tokenizer.encode(result))


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    celsius: int


def test_sdk_parse_with_a_pydantic_model(oai):
    r = oai.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather, max_tokens=48,
                                   temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather) and len(parsed.city) <= 10


def test_langchain_bind_tools_and_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="the dev extra installs langchain-openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=server.http_url + "/v1", api_key="unused",
                                      temperature=0, max_tokens=64, max_retries=0)
    msg = llm.bind_tools([TOOLS[0]], tool_choice="get_weather").invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke("Weather in Paris, in celsius?")
        assert isinstance(out, Weather), method
