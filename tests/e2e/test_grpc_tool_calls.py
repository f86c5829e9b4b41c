"""Tool calling over gRPC (GenerateRequest.tools / tool_choice, GenerateResponse.tool_calls) against the session
server: the same plan, constraint and streamed call pieces as the HTTP API."""
from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [pb.Tool(name="get_weather", description="Weather now", parameters_json=json.dumps(WEATHER)),
         pb.Tool(name="get_time", parameters_json='{"type": "object", "properties": {}, "additionalProperties": false}')]
MESSAGES = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather in Paris?")])


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def _calls(responses) -> tuple[dict[int, dict], str, int]:
    calls: dict[int, dict] = {}
    text, finish = "", pb.FINISH_REASON_UNSPECIFIED
    for r in responses:
        text += r.text
        finish = r.finish_reason or finish
        for d in r.tool_calls:
            if d.id:
                assert d.index not in calls and d.name
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": d.arguments}
            else:
                calls[d.index]["arguments"] += d.arguments
    return calls, text, finish


@pytest.mark.parametrize("choice", [pb.ToolChoice(function_name="get_weather"),
                                    pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)], ids=["named", "required"])
def test_named_and_required_give_valid_calls(stub, choice):
    for seed in range(5):
        req = pb.GenerateRequest(messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                 sampling=pb.SamplingParams(max_tokens=48, temperature=1.0, seed=seed))
        calls, text, finish = _calls(stub.Generate(req, timeout=120))
        assert text == "" and finish == pb.FINISH_REASON_TOOL_CALLS and list(calls) == [0]
        if choice.WhichOneof("choice") == "function_name":
            assert calls[0]["name"] == "get_weather"
        if calls[0]["name"] == "get_weather":
            jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_agent_turn_messages_carry_tool_calls_and_results(stub):
    history = pb.ChatMessages(messages=[
        *MESSAGES.messages,
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="call-1", name="get_weather",
                                                                 arguments='{"city": "Paris"}')]),
        pb.ChatMessage(role="tool", tool_call_id="call-1", content='{"celsius": 18}')])
    req = pb.GenerateRequest(messages=history, tools=TOOLS, tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
                             sampling=pb.SamplingParams(max_tokens=6, temperature=0))
    calls, text, finish = _calls(stub.Generate(req, timeout=120))
    assert not calls and text and finish in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("req,field", [
    (pb.GenerateRequest(messages=MESSAGES, tools=TOOLS), "tool_choice"),  # auto: this server has no parser
    (pb.GenerateRequest(messages=MESSAGES, tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)),
     "tool_choice"),
    (pb.GenerateRequest(messages=MESSAGES, tools=[pb.Tool(name="f", parameters_json="{")],
                        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)), "tools[0].parameters_json"),
])
def test_bad_tool_requests_are_invalid_argument_naming_the_field(stub, req, field):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()


def test_client_library_takes_openai_shaped_tools_and_history(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    calls, text, finish = _calls(client.generate(
        messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=48, temperature=0))
    assert finish == pb.FINISH_REASON_TOOL_CALLS and calls[0]["name"] == "get_weather"
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": calls[0]["id"], "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C"}]
    _, answer, finish = _calls(client.generate(messages=history, tools=tools, tool_choice="none", max_tokens=4,
                                               temperature=0))
    assert answer and finish in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    with pytest.raises(ValueError, match="tool_choice"):
        client.generate(prompt="x", tool_choice="sometimes")
