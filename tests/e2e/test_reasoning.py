"""Reasoning models (``--reasoning-parser``) end to end, on a tiny scripted model (tests/reasoning_model.py: a
one-layer Llama that writes the tokens a test chains, so ``</think>`` comes exactly where a reasoning model would
write it) behind chat templates that emit think tags, one server per parser:

- deepseek_r1: the template ends with ``<think>``; the model writes the reasoning, ``</think>`` and the answer.
  Non-streamed and streamed split, ``reasoning_tokens``, ``include_reasoning: false``, a JSON schema after the
  reasoning (valid JSON content while the reasoning is free text), a tool call after a reasoning that itself
  shows a ``<tool_call>`` (parsed from the content only), a required tool choice's grammar after the reasoning,
  a choice cut inside its reasoning, and gRPC ``reasoning_text`` / ``Usage.reasoning_tokens`` / ``GetModelInfo``.
- qwen3: the model writes ``<think>...</think>``; ``chat_template_kwargs: {"enable_thinking": false}`` reaches the
  template, which then closes the reasoning in the prompt, and the answer is all content (HTTP and gRPC); a JSON
  schema then holds the text from its first token.
- gpt_oss: harmony channels as text (analysis -> reasoning, final -> content; the final text held to a regex).
- the engine alone: ngram drafts running through ``</think>`` under a JSON schema (rollback across the tag).
"""
from __future__ import annotations

import json
import sys

import grpc
import httpx
import pytest

from reasoning_model import encode, successors, tag_tokenizer, write_scripted_model
from support import ServerThread, free_port

pytestmark = pytest.mark.e2e

REASONING = 'Let me think, maybe <tool_call>{"name": "lookup"} fits'
ANSWER = "The answer is four"
CONTENT = "\n\n" + ANSWER
PONDER = " Pondering deeply"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
DEEPSEEK_TEMPLATE = ("{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                     "{%- if add_generation_prompt %}<|Assistant|><think>{% endif %}")
QWEN3_TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
GPT_OSS_TEMPLATE = ("{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{%- if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}}, "required": ["answer"],
          "additionalProperties": False}


def chains(tok) -> list[list[int]]:
    eos = tok.eos_token_id
    think, end = encode(tok, "<think>"), encode(tok, "</think>")
    return [
        # deepseek_r1 (the prompt ends with <think>) and qwen3 (the prompt ends with "\n", the model opens <think>)
        encode(tok, "\n") + think + encode(tok, REASONING) + end + encode(tok, "\n\n") + encode(tok, ANSWER) + [eos],
        # gpt_oss: the prompt opened the analysis channel
        encode(tok, "<|message|>", PONDER, "<|end|>", "<|start|>", "assistant", "<|channel|>", "final",
               "<|message|>"),
    ]


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory, smollm_source):
    tok = tag_tokenizer(smollm_source.load_tokenizer())
    path = tmp_path_factory.mktemp("scripted") / "model"
    write_scripted_model(str(path), tok, chains(tok))
    return str(path), tok


def _server(model, parser: str, template: str, **server_kwargs) -> ServerThread:
    from pagedserve.config import EngineConfig, ServerConfig

    return ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=free_port(), embedding_model="",
                                     served_model_name=f"tiny-{parser}", chat_template=template, **server_kwargs),
                        EngineConfig(model=model[0], device="cpu", dtype="float32", attention_backend="torch",
                                     quantization="none", max_model_len=512, enforce_eager=True,
                                     kv_cache_memory_bytes=16 << 20, reasoning_parser=parser))


@pytest.fixture(scope="module")
def deepseek(scripted_model):
    s = _server(scripted_model, "deepseek_r1", DEEPSEEK_TEMPLATE, enable_auto_tool_choice=True,
                tool_call_parser="hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen3(scripted_model):
    s = _server(scripted_model, "qwen3", QWEN3_TEMPLATE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gpt_oss(scripted_model):
    s = _server(scripted_model, "gpt_oss", GPT_OSS_TEMPLATE)
    yield s
    s.stop()


def _chat(server, **body) -> dict:
    r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=120,
                   json={"messages": MESSAGES, "temperature": 0, "max_tokens": 64, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.http_url}/v1/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "temperature": 0, "max_tokens": 64, "stream": True,
                            "stream_options": {"include_usage": True}, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def _joined(chunks, key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def _reasoning_token_count(tok, opened_in_prompt: bool) -> int:
    """Tokens of the reasoning part: the reasoning text's, the end tag's and (when generated) the start tag's."""
    return len(encode(tok, REASONING)) + 1 + (0 if opened_in_prompt else 1)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_think_tags_split_non_streamed_and_streamed(parser, request, scripted_model):
    server = request.getfixturevalue("deepseek" if parser == "deepseek_r1" else "qwen3")
    tok = scripted_model[1]
    body = _chat(server)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == REASONING
    assert message["content"] == CONTENT and "tool_calls" not in message   # no tools asked for
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    expected = _reasoning_token_count(tok, opened_in_prompt=parser == "deepseek_r1")
    assert usage["completion_tokens_details"]["reasoning_tokens"] == expected
    assert usage["completion_tokens"] > expected

    chunks = _stream(server)
    assert _joined(chunks, "reasoning_content") == _joined(chunks, "reasoning") == REASONING
    assert _joined(chunks, "content") == CONTENT
    for c in chunks:   # no piece of a tag is ever shown, in either field
        for key in ("content", "reasoning_content"):
            text = (c["choices"][0]["delta"].get(key) or "") if c["choices"] else ""
            assert "think>" not in text and "</" not in text, c
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == expected


def test_cut_inside_the_reasoning_is_all_reasoning(deepseek, scripted_model):
    choice = _chat(deepseek, max_tokens=5)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == scripted_model[1].decode(encode(scripted_model[1], REASONING)[:5])


def test_include_reasoning_false_drops_it_but_counts_it(deepseek, scripted_model):
    body = _chat(deepseek, include_reasoning=False)
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and "reasoning" not in message
    assert message["content"] == CONTENT
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == \
        _reasoning_token_count(scripted_model[1], True)
    chunks = _stream(deepseek, include_reasoning=False)
    assert _joined(chunks, "reasoning_content") == "" and _joined(chunks, "content") == CONTENT


def test_json_schema_applies_after_the_reasoning_only(deepseek):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    for stream in (False, True):
        if stream:
            chunks = _stream(deepseek, response_format=fmt)
            reasoning, content = _joined(chunks, "reasoning_content"), _joined(chunks, "content")
        else:
            message = _chat(deepseek, response_format=fmt)["choices"][0]["message"]
            reasoning, content = message["reasoning_content"], message["content"]
        assert reasoning == REASONING          # free text: the grammar did not hold the thinking
        value = json.loads(content)            # the model's own answer was prose; the grammar made it JSON
        assert set(value) == {"answer"} and value["answer"] in ("four", "five"), content


def test_tool_call_after_reasoning_is_parsed_from_the_content_only(deepseek):
    forced = {"tools": TOOLS, "tool_choice": "auto", "structured_outputs": {"regex": CALL_REGEX}}
    choice = _chat(deepseek, **forced)["choices"][0]
    message = choice["message"]
    assert '<tool_call>{"name": "lookup"}' in message["reasoning_content"]   # not read as a call
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert choice["finish_reason"] == "tool_calls"
    chunks = _stream(deepseek, **forced)
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert {t["function"].get("name") for t in calls} - {None} == {"get_weather"}
    assert "lookup" in _joined(chunks, "reasoning_content")


def test_required_tool_choice_grammar_starts_after_the_reasoning(deepseek):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}]   # bounded: the scripted model takes the lowest allowed token
    choice = _chat(deepseek, tools=tools, tool_choice="required", parallel_tool_calls=False)["choices"][0]
    assert choice["message"]["reasoning_content"] == REASONING
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Oslo"})]


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token(qwen3):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    message = _chat(qwen3, response_format=fmt, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert message["reasoning_content"] is None and json.loads(message["content"])["answer"] in ("four", "five")


def test_grpc_reasoning_text_usage_and_model_info(deepseek, qwen3, scripted_model):
    from pagedserve_client import PagedServeClient
    from pagedserve_client.v1 import inference_pb2 as pb

    with PagedServeClient(deepseek.target, timeout_s=120) as c:
        result = c.generate_text(messages=[("user", "What is 2 + 2?")], max_tokens=64, temperature=0)
        assert (result.reasoning_text, result.text) == (REASONING, CONTENT)
        assert result.usage.reasoning_tokens == _reasoning_token_count(scripted_model[1], True)
        streamed = list(c.generate(messages=[("user", "What is 2 + 2?")], max_tokens=64, temperature=0))
        assert "".join(r.reasoning_text for r in streamed) == REASONING
        assert all("</" not in r.reasoning_text and "</" not in r.text for r in streamed)
        hidden = c.generate_text(messages=[("user", "x")], max_tokens=64, temperature=0, include_reasoning=False)
        assert (hidden.reasoning_text, hidden.text) == ("", CONTENT)
        assert c.stub.GetModelInfo(pb.GetModelInfoRequest()).generation.reasoning_parser == "deepseek_r1"
    from structlog.testing import capture_logs
    with capture_logs() as logs:
        deepseek.app._log_summary(0.0)   # the ready line
    assert [e["reasoning_parser"] for e in logs if e["event"] == "ready"] == ["deepseek_r1"]
    with PagedServeClient(qwen3.target, timeout_s=120) as c:
        off = c.generate_text(messages=[("user", "x")], max_tokens=64, temperature=0,
                              chat_template_kwargs={"enable_thinking": False})
        assert (off.reasoning_text, off.text, off.usage.reasoning_tokens) == ("", ANSWER, 0)
        with pytest.raises(grpc.RpcError) as info:
            c.generate_text(messages=[("user", "x")], max_tokens=4, chat_template_kwargs={"tools": []})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat_template_kwargs.tools" in info.value.details()


def test_enable_thinking_false_reaches_the_template(qwen3):
    body = _chat(qwen3, chat_template_kwargs={"enable_thinking": False})
    message = body["choices"][0]["message"]
    # the template closed the reasoning in the prompt: the model goes straight to the answer, all content
    assert message["reasoning_content"] is None and message["content"] == ANSWER
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    on = _chat(qwen3, chat_template_kwargs={"enable_thinking": True})
    assert on["usage"]["prompt_tokens"] + 4 == body["usage"]["prompt_tokens"]   # "<think>", "\n\n", "</think>", "\n\n"
    rendered = {}
    for flag in (True, False):
        r = httpx.post(f"{qwen3.http_url}/tokenize", timeout=60, json={
            "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": flag}})
        ids = r.json()["tokens"]
        rendered[flag] = httpx.post(f"{qwen3.http_url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert rendered[False] == rendered[True] + "<think>\n\n</think>\n\n"
    for bad, param in (("yes", "chat_template_kwargs"), ({"tools": []}, "chat_template_kwargs.tools")):
        r = httpx.post(f"{qwen3.http_url}/v1/chat/completions", timeout=60,
                       json={"messages": MESSAGES, "chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_gpt_oss_channels(gpt_oss):
    forced = {"structured_outputs": {"regex": "Four, finally"}}
    message = _chat(gpt_oss, **forced)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (PONDER, "Four, finally")
    chunks = _stream(gpt_oss, **forced)
    assert (_joined(chunks, "reasoning_content"), _joined(chunks, "content")) == (PONDER, "Four, finally")
    assert all("<|" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])


def test_chains_are_consistent(scripted_model):
    successors(chains(scripted_model[1]))


def test_speculative_drafts_across_the_end_tag_keep_the_grammar_after_the_reasoning(scripted_model):
    """ngram drafts copied from the prompt run through ``</think>`` into prose: the gate lets the reasoning's
    drafts through, checks those past the end tag against the JSON grammar and rolls back across the tag."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.reasoning import get_parser, split_whole
    from pagedserve.sampling_params import SamplingParams
    from support import run_to_completion

    path, tok = scripted_model
    engine, _ = build_engine(EngineConfig(
        model=path, device="cpu", dtype="float32", attention_backend="torch", quantization="none",
        max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=16 << 20, reasoning_parser="deepseek_r1",
        speculative_config='{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, '
                           '"prompt_lookup_min": 1}'))
    try:
        prompt = encode(tok, REASONING, "</think>", "\n\n", ANSWER, "\n", "<think>")   # the ngram source
        engine.add_request("spec", prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                          structured_output={"json_schema": json.dumps(SCHEMA)}))
        _, _, text = run_to_completion(engine)["spec"][0]
        reasoning, content = split_whole(get_parser("deepseek_r1"), text, "<think>")
        assert reasoning == REASONING and json.loads(content)["answer"] in ("four", "five"), text
        assert engine.drafter.num_accepted_tokens > 0   # drafts did run (through the reasoning)
    finally:
        engine.close()


def test_cli_writes_reasoning_to_stderr_and_content_to_stdout(deepseek, qwen3, scripted_model):
    import subprocess

    from pagedserve_client import cli

    def run(*argv) -> tuple[str, str]:   # a process of its own: the in-process servers log to this one's stdout
        done = subprocess.run([sys.executable, "-m", "pagedserve_client.cli", *argv], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr

    ask = ("generate", "--chat", "What is 2 + 2?", "--max-tokens", "64", "--temperature", "0")
    out, err = run("--target", deepseek.target, *ask)
    assert out == CONTENT and err.startswith(REASONING)
    assert f"reasoning_tokens={_reasoning_token_count(scripted_model[1], True)}" in err
    out, err = run("--target", deepseek.target, *ask, "--no-include-reasoning")
    assert out == CONTENT and REASONING not in err
    out, err = run("--target", qwen3.target, *ask, "--chat-template-kwargs", '{"enable_thinking": false}')
    assert out == ANSWER and "reasoning_tokens=0" in err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--chat-template-kwargs", "[1]"])
