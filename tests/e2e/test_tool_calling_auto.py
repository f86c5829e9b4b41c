"""``tool_choice: auto`` with ``--enable-auto-tool-choice --tool-call-parser hermes`` and ``--chat-template`` on a
small random-weight Qwen2-shape model (SmolLM2's tokenizer, a Hermes-style template that renders ``tools``, tool
calls and tool results). Random weights say nothing useful, so the calls are made to appear with a regex
constraint on the output; what is tested is the server's path: template -> model -> hermes parser -> message /
streamed deltas, and a full agent turn."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from support import ServerThread, free_port

pytestmark = pytest.mark.e2e

MODEL = "tiny-qwen2-tools"
TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
# What a Hermes model answers when it calls a tool: some text, then the call block.
CALL_REGEX = r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Bergen)"\}\}\n</tool_call>'


def write_tiny_qwen2(path: str, tokenizer) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory, smollm_source):
    from pagedserve.config import EngineConfig, ServerConfig

    tokenizer = smollm_source.load_tokenizer()
    root = tmp_path_factory.mktemp("tiny-qwen2")
    write_tiny_qwen2(str(root / "model"), tokenizer)
    (root / "tools.jinja").write_text(TEMPLATE)
    s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=free_port(), embedding_model="",
                                  served_model_name=MODEL, chat_template=str(root / "tools.jinja"),
                                  enable_auto_tool_choice=True, tool_call_parser="hermes",
                                  allowed_origins='["https://app.example"]', allow_credentials=True),
                     EngineConfig(model=str(root / "model"), device="cpu", dtype="float32",
                                  attention_backend="torch", quantization="none", max_model_len=1024))
    s.tokenizer = tokenizer
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(auto_server):
    with openai.OpenAI(base_url=auto_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _rendered_len(tokenizer, messages, tools) -> int:
    return len(tokenizer.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE, tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"])


def _forced(**kw) -> dict:
    return dict(model=MODEL, tools=TOOLS, max_tokens=80, temperature=1.0,
                extra_body={"structured_outputs": {"regex": CALL_REGEX}}, **kw)


def test_auto_parses_hermes_calls_and_the_template_renders_tools(oai, auto_server):
    r = oai.chat.completions.create(messages=MESSAGES, **_forced())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Bergen")
    assert r.usage.prompt_tokens == _rendered_len(auto_server.tokenizer, MESSAGES, TOOLS)
    assert r.usage.prompt_tokens > _rendered_len(auto_server.tokenizer, MESSAGES, None)


def test_auto_streams_content_then_call_deltas(oai):
    chunks = list(oai.chat.completions.create(messages=MESSAGES, stream=True, **_forced()))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "Checking."  # the tags and the JSON never leak into content
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments or "" for d in deltas))["city"] in ("Oslo", "Bergen")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


# Two parallel calls whose arguments come before the name (as some models order the keys): the name completes
# with the arguments already there, so each call's first entry carries both.
TWO_CALLS_REGEX = (r'<tool_call>\n\{"arguments": \{"city": "Oslo"\}, "name": "get_weather"\}\n</tool_call>\n'
                   r'<tool_call>\n\{"arguments": \{"city": "Bergen"\}, "name": "get_weather"\}\n</tool_call>')


def test_parallel_streamed_calls_send_one_entry_per_index_per_chunk(auto_server, oai):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "temperature": 0,
            "stream": True, "structured_outputs": {"regex": TWO_CALLS_REGEX}}
    entries = []
    with httpx.stream("POST", auto_server.http_url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                entries += [c["delta"]["tool_calls"] for c in json.loads(line[6:])["choices"]
                            if c["delta"].get("tool_calls")]
    assert all(len({d["index"] for d in e}) == len(e) for e in entries), entries
    headers = [d for e in entries for d in e if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in headers] == [(0, "get_weather"), (1, "get_weather")]
    assert [json.loads(d["function"]["arguments"]) for d in headers] == [{"city": "Oslo"}, {"city": "Bergen"}]
    with oai.chat.completions.stream(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                     tools=[{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}],
                                     extra_body={"structured_outputs": {"regex": TWO_CALLS_REGEX}}) as stream:
        calls = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.parsed_arguments) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
    assert len({c.id for c in calls}) == 2


def test_auto_plain_text_stays_content(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=6, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": "It is sunny"}})
    assert r.choices[0].message.content == "It is sunny" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_agent_turn_with_the_tool_result_in_the_template(oai, auto_server):
    first = oai.chat.completions.create(messages=MESSAGES, **_forced())
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content,
                           "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 4}'}]
    answer = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8,
                                         extra_body={"structured_outputs": {"regex": "It is 4C in Oslo"}})
    assert answer.choices[0].message.content == "It is 4C in Oslo" and answer.choices[0].finish_reason == "stop"
    template_history = history[:1] + [{**history[1], "tool_calls": [
        {**call.model_dump(), "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
        history[2]]
    assert answer.usage.prompt_tokens == _rendered_len(auto_server.tokenizer, template_history, TOOLS)


def test_cors_with_configured_origins_and_credentials(auto_server):
    with httpx.Client(base_url=auto_server.http_url, timeout=30) as http:
        ok = http.options("/v1/models", headers={"Origin": "https://app.example",
                                                  "Access-Control-Request-Method": "GET"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = http.options("/v1/models", headers={"Origin": "https://evil.example",
                                                     "Access-Control-Request-Method": "GET"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
