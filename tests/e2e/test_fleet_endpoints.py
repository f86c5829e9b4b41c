"""The routes a router in front of several replicas asks each replica: render (chat and completions), get_load,
and the /tokenize bodies vllm-router sends; on the session server (embedded model, HTTP)."""
from __future__ import annotations

import threading

import httpx
import pytest

from support import wait_until

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi there"}]
# Fields vllm-router adds to every chat body it forwards or renders (seen on the wire): accepted and ignored.
ROUTER_FIELDS = {"no_stop_trim": False, "continue_final_message": False, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


def _model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_chat_render_is_the_templated_prompt(http):
    model = _model(http)
    r = http.post("/v1/chat/completions/render", json={"model": model, "messages": MESSAGES, "temperature": 0.25,
                                                       "max_tokens": 7, "stream": True, **ROUTER_FIELDS})
    assert r.status_code == 200, r.text
    out = r.json()
    tokens = http.post("/tokenize", json={"model": model, "messages": MESSAGES}).json()["tokens"]
    assert out["token_ids"] == tokens and len(tokens) > 5
    assert out["request_id"].startswith("chatcmpl-") and out["model"] == model and out["stream"] is True
    assert out["sampling_params"]["temperature"] == 0.25 and out["sampling_params"]["max_tokens"] == 7
    assert out["features"] is None and out["token_offsets"] is None
    # the router's /tokenize fallback body (messages with continue_final_message) gives the same ids
    routed = http.post("/tokenize", json={"model": model, "continue_final_message": False, "messages": MESSAGES})
    assert routed.status_code == 200 and routed.json()["tokens"] == tokens


def test_completions_render_one_entry_per_prompt(http):
    model = _model(http)
    prompts = ["The capital of France is", "Two plus two is"]
    r = http.post("/v1/completions/render", json={"model": model, "prompt": prompts, "echo": False,
                                                  "no_stop_trim": False, "request_id": "abc"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [e["request_id"] for e in out] == ["abc-0", "abc-1"]
    for entry, prompt in zip(out, prompts):
        assert entry["token_ids"] == http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert entry["sampling_params"]["max_tokens"] == 16  # OpenAI's completions default
    single = http.post("/v1/completions/render", json={"prompt": "Hello"}).json()
    assert len(single) == 1 and single[0]["request_id"].startswith("cmpl-")


def test_render_checks_the_body_like_generation(http):
    wrong = http.post("/v1/chat/completions/render", json={"model": "nope", "messages": MESSAGES})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
    bad = http.post("/v1/completions/render", json={"prompt": "x", "temperature": -1})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    empty = http.post("/v1/chat/completions/render", json={"messages": []})
    assert empty.status_code == 400


def test_get_load_counts_a_running_request(http, server):
    idle = http.get("/get_load")
    assert idle.status_code == 200
    assert set(idle.json()) == {"load", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
    seen: list[dict] = []
    done = threading.Event()

    def generate():
        try:
            http.post("/v1/completions", json={"prompt": "Count slowly:", "max_tokens": 200, "ignore_eos": True})
        finally:
            done.set()

    threading.Thread(target=generate, daemon=True).start()

    def busy() -> bool:
        load = http.get("/get_load").json()
        seen.append(load)
        return load["load"] >= 1 or done.is_set()

    wait_until(busy, 120, "get_load never saw the request")
    busy_load = next(s for s in seen if s["load"] >= 1)
    assert busy_load["num_requests_running"] + busy_load["num_requests_waiting"] == busy_load["load"]
    assert 0 < busy_load["kv_cache_usage_perc"] <= 1
    done.wait(300)
    wait_until(lambda: http.get("/get_load").json()["load"] == 0, 60, "load did not return to 0")
