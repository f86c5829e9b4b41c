"""What SDKs, scorers and browsers rely on, against the session server: options that only go together, every
400's ``param`` as the client spelled the field, prompt scoring (``echo`` + ``max_tokens: 0``), logprobs as the
reference defines them (completions' top_logprobs with the chosen token, chat's per-token ``bytes``), CORS and
``GET /v1/models/{model}``."""
from __future__ import annotations

import json
import math
import time

import grpc
import httpx
import openai
import pytest

from support import free_port, server_sharing_model

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": False,
                         "stream_options": {"include_usage": True}}),
])
def test_stream_options_without_stream_is_400(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["x"] * 17}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 10**4}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 100_000}]}, "messages"),
    ("/v1/completions", {"prompt": [10**7]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**4}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 10**4, "max_tokens": 1}, "logprobs"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[101, 102], [10**7]]}, "input[1]"),
    ("/v1/embeddings", {"input": 5}, "input"),
])
def test_400_param_is_the_body_field_as_sent(http, path, body, param):
    r = http.post(path, json={"max_tokens": 4, **body} if path != "/v1/embeddings" else body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "sampling." not in error["message"] and "inputs" not in error["message"]


CONTEXT_HEAD = "This model's maximum context length is {} tokens. However, you requested "


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 9000}]}, "messages",
     "tokens in the messages, which leaves no room"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 9000}], "max_tokens": 5},
     "messages", "in the messages, 5 in the completion). Please reduce the length of the messages or completion."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 120_000}]}, "messages",
     "at least"),  # refused from its size before tokenizing
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8192}, "max_tokens", "8192 in the completion"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 8190}, "max_completion_tokens",
     "8190 in the completion"),
    ("/v1/completions", {"prompt": [5] * 8192, "max_tokens": 1}, "prompt",
     "8193 tokens (8192 in the prompt, 1 in the completion)"),
    ("/v1/completions", {"prompt": "hello " * 9000}, "prompt",
     "in the completion). Please reduce the length of the prompt"),
    ("/v1/completions", {"prompt": "Hello world", "max_tokens": 8191}, "max_tokens",
     "8193 tokens (2 in the prompt, 8191 in the completion)"),
])
def test_exceeding_the_context_is_openais_context_length_exceeded(server, http, oai, path, body, param, words):
    """OpenAI's message and code, which LiteLLM's context-window fallbacks match; ``param`` names the field."""
    max_model_len = server.engine.max_model_len
    assert max_model_len == 8192  # the numbers above
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(CONTEXT_HEAD.format(max_model_len))
    assert words in error["message"], error["message"]
    streamed = http.post(path, json={"model": MODEL, "stream": True, **body})
    assert streamed.status_code == 400 and streamed.json()["error"] == error


def test_grpc_exceeding_the_context_is_invalid_argument_naming_the_field(server, client):
    n = server.engine.max_model_len
    for kwargs, field, words in [({"prompt_token_ids": [5] * n}, "prompt", f"{n} tokens in the prompt"),
                                 ({"prompt": "Hello world", "max_tokens": n - 1}, "sampling.max_tokens",
                                  f"{n + 1} tokens (2 in the prompt, {n - 1} in the completion)")]:
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(**kwargs))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{field}: " + CONTEXT_HEAD.format(n)), info.value.details()
        assert words in info.value.details()


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hello"}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_best_of_1_is_accepted_and_anything_else_is_refused_naming_it(http, path, body):
    base = {"model": MODEL, "max_tokens": 3, "temperature": 0, **body}
    plain = http.post(path, json=base).json()["choices"]
    for accepted in (1, None):
        r = http.post(path, json={**base, "best_of": accepted})
        assert r.status_code == 200 and r.json()["choices"] == plain, r.text
    for best_of, n, code in [(2, 1, "unsupported"), (3, 3, "unsupported"), (1, 2, None), (0, 1, None)]:
        r = http.post(path, json={**base, "best_of": best_of, "n": n})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "best_of" and error["code"] == code and error["message"].startswith("best_of: ")


def test_sdk_completions_with_best_of_1(oai):
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, best_of=1, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def _ids_of(labels: list[str]) -> list[int]:
    assert all(label.startswith("token_id:") for label in labels), labels
    return [int(label.removeprefix("token_id:")) for label in labels]


def _streamed_chat_logprobs(http, body: dict) -> list[dict]:
    entries = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    entries += (c["logprobs"] or {}).get("content", [])
    return entries


def test_chat_return_tokens_as_token_ids(http, tokenizer):
    """vLLM's extension: every logprob token (chosen and top) as ``token_id:<id>``; streamed as whole. (Each call
    its own cache salt: every prefill runs the same way, so the logprobs are the same.)"""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    plain = http.post("/v1/chat/completions", json={**body, "cache_salt": "plain"}).json()["choices"][0]
    as_ids = http.post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": True,
                                                     "cache_salt": "ids"}).json()["choices"][0]
    assert as_ids["message"] == plain["message"]
    ids = _ids_of([e["token"] for e in as_ids["logprobs"]["content"]])
    assert tokenizer.decode(ids) == plain["message"]["content"]
    for mine, theirs, tid in zip(as_ids["logprobs"]["content"], plain["logprobs"]["content"], ids):
        assert theirs["token"] == tokenizer.decode([tid]) and mine["bytes"] == theirs["bytes"]
        assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-5)
        top = _ids_of([t["token"] for t in mine["top_logprobs"]])
        assert top[0] == tid and [tokenizer.decode([t]) for t in top] == [t["token"] for t in theirs["top_logprobs"]]
    streamed = _streamed_chat_logprobs(http, {**body, "return_tokens_as_token_ids": True, "cache_salt": "stream"})
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in streamed] == \
        [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in as_ids["logprobs"]["content"]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_return_tokens_as_token_ids_with_echo(http, tokenizer, stream):
    prompt = "The capital of France is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True,
            "stream": stream}
    plain, as_ids = (_completion_logprobs(http, {**body, "return_tokens_as_token_ids": flag, "cache_salt": f"{flag}"})
                     for flag in (False, True))
    ids = _ids_of(as_ids["tokens"])
    prompt_ids = tokenizer.encode(prompt)
    assert ids[:len(prompt_ids)] == prompt_ids and [tokenizer.decode([t]) for t in ids] == plain["tokens"]
    assert as_ids["text_offset"] == plain["text_offset"]
    assert as_ids["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    assert as_ids["top_logprobs"][0] is None
    for tid, top in zip(ids[1:], as_ids["top_logprobs"][1:]):
        assert f"token_id:{tid}" in top and all(k.startswith("token_id:") for k in top)


def _completion_logprobs(http, body: dict) -> dict:
    """The choice's logprobs, joined over the chunks when streamed."""
    if not body["stream"]:
        return http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    for key in out:
                        out[key] += c["logprobs"][key]
    return out


def test_scored_prompt_echo_with_max_tokens_0_matches_the_engine_prompt_logprobs(oai, client):
    prompt = "The capital of France is Paris."
    r = oai.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=2, temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    lps = choice.logprobs
    assert "".join(lps.tokens) == prompt and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    msgs = list(client.generate(prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=2))
    engine = [e.logprob for m in msgs for e in m.prompt_logprobs]
    assert len(engine) == len(lps.tokens) - 1
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(lps.token_logprobs[1:], engine))
    streamed = list(oai.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=2,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt


def test_echo_with_max_tokens_0_and_no_logprobs_returns_the_prompt(oai):
    r = oai.completions.create(model=MODEL, prompt="Hello there", echo=True, max_tokens=0)
    assert r.choices[0].text == "Hello there" and r.usage.completion_tokens == 0


def test_completion_top_logprobs_include_the_chosen_token(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon a", max_tokens=6, temperature=1.0, seed=7, logprobs=1,
                               echo=True)
    lps = r.choices[0].logprobs
    for token, lp, top in zip(lps.tokens[1:], lps.token_logprobs[1:], lps.top_logprobs[1:]):
        assert top[token] == pytest.approx(lp) and 1 <= len(top) <= 2


def test_chat_logprob_bytes_join_to_a_character_split_over_tokens(oai, tokenizer):
    char = next(c for c in "龘鱻靐齉" if len(tokenizer.encode(c, add_special_tokens=False)) > 1)
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=2,
                                    extra_body={"guided_choice": [char + "!"]})
    content = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8") == char + "!" == r.choices[0].message.content
    assert len(content) > 2  # the character came in pieces, each with its own bytes
    assert any(_not_utf8(bytes(e.bytes)) for e in content)
    for e in content:
        for alt in e.top_logprobs:
            assert alt.bytes is not None


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_cors_preflight_and_simple_request_with_defaults(http):
    r = http.options("/v1/chat/completions", headers={"Origin": "https://page.example",
                                                      "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": "content-type,authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = http.get("/v1/models", headers={"Origin": "https://page.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_models_retrieve(oai, http):
    model = oai.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    assert model == oai.models.list().data[0]
    r = http.get("/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_cards_carry_the_start_time_owner_and_context_length(server, oai):
    """vLLM's cards: ``created`` the server's start (unix seconds, not 0), ``owned_by``, ``max_model_len``."""
    cards = {m.id: m for m in oai.models.list().data}
    assert set(cards) == {MODEL, "all-MiniLM-L6-v2"}
    now = time.time()
    for card in cards.values():
        assert now - 24 * 3600 < card.created <= now and card.owned_by == "pagedserve"
    assert len({c.created for c in cards.values()}) == 1
    assert cards[MODEL].created == oai.models.retrieve(MODEL).created
    assert cards[MODEL].model_extra["max_model_len"] == server.engine.max_model_len
    assert cards["all-MiniLM-L6-v2"].model_extra["max_model_len"] == server.app.services.embedding.info.max_input_tokens
    # what the generation model is (SmolLM2-135M: Llama, 30 layers, 3 KV heads of 64, no window, dense)
    extra = cards[MODEL].model_extra
    assert (extra["architecture"], extra["sliding_windows"], extra["num_experts"], extra["num_experts_per_token"]) \
        == ("LlamaForCausalLM", [], 0, 0)
    info = server.app.services.generation.info
    assert extra["kv_layout"] == {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
                                  "kv_cache_dtype": info.kv_cache_dtype, "block_size": info.block_size}
    assert "architecture" not in cards["all-MiniLM-L6-v2"].model_extra


def test_cors_preflight_needs_no_api_key_but_the_call_does(server):
    with server_sharing_model(server, http_port=free_port(), server_kwargs={"api_key": "sekret"}) as keyed, \
            httpx.Client(base_url=keyed.http_url, timeout=60) as http:
        pre = http.options("/v1/models", headers={"Origin": "https://page.example",
                                                   "Access-Control-Request-Method": "GET",
                                                   "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        assert http.get("/v1/models", headers={"Origin": "https://page.example"}).status_code == 401
        ok = http.get("/v1/models", headers={"Origin": "https://page.example", "Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
