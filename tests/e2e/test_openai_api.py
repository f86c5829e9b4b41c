"""The OpenAI-compatible HTTP API as its users call it: the official `openai` SDK (sync and async, no retries) and
raw httpx, against the session server that also serves gRPC. gRPC is the oracle: the same engine must give the
same tokens and vectors through either front end."""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading

import httpx
import openai
import pytest

from support import assert_no_blocks_held, free_port, server_sharing_model, wait_until

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def grpc_greedy(client, tokenizer, messages, max_tokens):
    """(text, per-token strings, finish reason) of a greedy gRPC Generate."""
    msgs = list(client.generate(messages=[(m["role"], m["content"]) for m in messages], max_tokens=max_tokens,
                                temperature=0))
    ids = [t for m in msgs for t in m.token_ids]
    return "".join(m.text for m in msgs), [tokenizer.decode([t]) for t in ids], msgs[-1].finish_reason


def test_greedy_chat_gives_the_same_tokens_as_grpc(server, oai, client, tokenizer):
    text, tokens, _ = grpc_greedy(client, tokenizer, MESSAGES, 24)
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True)
    choice = r.choices[0]
    assert choice.message.content == text and choice.message.role == "assistant"
    assert [e.token for e in choice.logprobs.content] == tokens
    assert r.usage.completion_tokens == len(tokens) and r.usage.total_tokens == r.usage.prompt_tokens + len(tokens)
    assert r.object == "chat.completion" and r.model == MODEL and r.system_fingerprint


def test_async_client_and_streamed_deltas_join_to_the_text(server, oai):
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)

    async def stream() -> tuple[str, list]:
        async with openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0) as c:
            chunks = [ch async for ch in await c.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
                stream_options={"include_usage": True})]
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks

    text, chunks = asyncio.run(stream())
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_raw_stream_ends_with_done(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_n_with_a_seed_is_reproducible(oai):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, n=3, seed=1234)
    first, second = (oai.chat.completions.create(**kw) for _ in range(2))
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1  # the three completions sample independently


def test_logprobs_with_and_without_top_logprobs(oai):
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True)
    for entry in plain.choices[0].logprobs.content:
        assert entry.logprob <= 0 and entry.top_logprobs == [] and bytes(entry.bytes).decode() == entry.token
    top = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                      top_logprobs=3, temperature=0)
    for entry in top.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    assert oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3).choices[0].logprobs is None


def test_stop_ends_with_finish_reason_stop(oai):
    base = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    text = base.choices[0].message.content
    stop = text.split()[1]
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    assert r.choices[0].message.content == text[:text.index(stop)]


def test_completions_echo_logprobs_and_token_prompts(oai, tokenizer):
    prompt = "The capital of France is"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(prompt) and r.object == "text_completion"
    ids = tokenizer.encode(prompt)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids) + 5
    assert choice.logprobs.text_offset[len(ids)] == len(prompt)
    batch = oai.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5, temperature=0)
    assert [c.text for c in batch.choices] == [choice.text[len(prompt):]] * 2
    assert batch.usage.prompt_tokens == 2 * len(ids)


def test_embeddings_float_and_base64_equal_grpc(server, oai, client):
    texts = ["hello world", "paged attention"]
    expected = [list(e.values) for e in client.embed(texts).embeddings]
    default = oai.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the SDK asks for base64
    floats = oai.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    raw = httpx.post(server.http_url + "/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    for i, vec in enumerate(expected):
        assert default.data[i].embedding == pytest.approx(vec, abs=1e-6)
        assert floats.data[i].embedding == pytest.approx(vec, abs=1e-6)
        b64 = base64.b64decode(raw["data"][i]["embedding"])
        assert list(struct.unpack(f"<{len(b64) // 4}f", b64)) == pytest.approx(vec, abs=1e-6)
    norm = sum(x * x for x in expected[0][:8]) ** 0.5
    assert oai.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0], dimensions=8).data[0].embedding \
        == pytest.approx([x / norm for x in expected[0][:8]], abs=1e-5)


def test_seed_article_client_code(server, oai):
    """The article's loop, unchanged except base_url and model."""
    client, model = oai, MODEL
    total = 0
    for question in ["What is the capital of France?", "Give one use of a hash map."]:
        response = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": question}], max_tokens=100, temperature=0.7)
        total += response.usage.total_tokens
        assert response.choices[0].message.content
    assert total > 0
    same = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, temperature=0.7,
                                           seed=42).choices[0].message.content for _ in range(2)]
    assert same[0] == same[1]
    # No max_tokens: the completion may run to max_model_len, so this server keeps that short (96 tokens).
    with server_sharing_model(server, http_port=free_port(), max_model_len=96) as short:
        r = httpx.post(short.http_url + "/v1/chat/completions", timeout=300,
                       json={"model": model, "messages": [{"role": "user", "content": "Reply with the word yes."}]})
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["message"]["content"]
    assert body["usage"]["total_tokens"] <= 96


def test_models_health_metrics_tokenize_detokenize(server, tokenizer):
    base = server.http_url
    models = httpx.get(base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "all-MiniLM-L6-v2"]
    assert httpx.get(base + "/health").status_code == 200
    metrics = httpx.get(base + "/metrics").text
    assert "pagedserve:num_requests_running" in metrics and "grpc_server_handled_total" in metrics
    tok = httpx.post(base + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["tokens"] == tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    assert tok["token_strs"] == tokenizer.convert_ids_to_tokens(tok["tokens"])
    chat = httpx.post(base + "/tokenize", json={"messages": MESSAGES}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert chat["tokens"] == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert httpx.post(base + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}


def test_tokenize_detokenize_tokenize_round_trips_a_chat_prompt(server, tokenizer):
    """/detokenize keeps special tokens (vLLM's default), so the rendered chat prompt's text tokenizes back to the
    same ids."""
    base = server.http_url
    ids = httpx.post(base + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert set(ids) & set(tokenizer.all_special_ids)  # the template's turn markers are special tokens
    text = httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == tokenizer.decode(ids, skip_special_tokens=False)
    again = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert again == ids


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"max_tokens": "many"}, "max_tokens"),
    ({"messages": []}, "messages"), ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    r = httpx.post(server.http_url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param and err["type"] == "invalid_request_error" and param.split("[")[0] in err["message"]
    assert_no_blocks_held(server)


def test_unknown_model_and_path_are_404(server, oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert info.value.body["param"] == "model" and "gpt-4o" in info.value.body["message"]
    r = httpx.get(server.http_url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_oversized_body_is_413(server):
    with server_sharing_model(server, http_port=free_port(),
                              server_kwargs={"max_request_body_bytes": 4096}) as small:
        r = httpx.post(small.http_url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
        assert r.status_code == 413 and _error(r)["type"] == "invalid_request_error"

        def chunks():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'
        r = httpx.post(small.http_url + "/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_api_key_guards_the_api_but_not_health_or_metrics(server):
    with server_sharing_model(server, http_port=free_port(), server_kwargs={"api_key": "s3cret"}) as guarded:
        url = guarded.http_url
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.post(url + "/detokenize", json={"tokens": [1]}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as c:
            assert c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices
        with openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as c, \
                pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert_no_blocks_held(guarded)


def test_full_queue_is_429_and_nothing_leaks(server):
    with server_sharing_model(server, http_port=free_port(), max_num_seqs=1, max_waiting_requests=1) as tiny:
        body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 40, "ignore_eos": True}
        results: list[int] = []

        def post():
            results.append(httpx.post(tiny.http_url + "/v1/completions", json=body, timeout=300).status_code)

        threads = [threading.Thread(target=post) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert 429 in results and 200 in results, results
        r = httpx.post(tiny.http_url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200
        assert_no_blocks_held(tiny)


def test_closing_a_stream_after_two_chunks_frees_every_block(server, oai):
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, stream=True,
                                         extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 1:
            break
    assert server.engine.has_unfinished()
    stream.close()
    assert_no_blocks_held(server)
    wait_until(lambda: not server.engine.groups, 10)


def test_a_non_streamed_request_whose_client_leaves_is_aborted(server):
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.http_url + "/v1/completions", json=body, timeout=3)
    assert_no_blocks_held(server)
