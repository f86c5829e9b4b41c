"""Speculative decoding end to end on the embedded SmolLM2-135M (a second server sharing the session server's
weights, with n-gram drafts): greedy output equals HF generate on the end-to-end chat prompts and on prompts the
answer quotes (where drafts are accepted), the Prometheus counters count drafts, and structured output under
speculation equals the plain server's."""
from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from support import CHAT_PROMPTS, assert_no_blocks_held, chat_ids, server_sharing_model

pytestmark = pytest.mark.e2e

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                   "disable_by_batch_size": None})
QUOTING_PROMPTS = [
    "Repeat this sentence exactly, word for word: 'The quick brown fox jumps over the lazy dog near the quiet "
    "river bank, and the dog does not move.'",
    "Rewrite this Python code with the function renamed to add_numbers:\n\ndef f(a, b):\n    result = a + b\n"
    "    return result\n",
]


@pytest.fixture(scope="module")
def spec_server(server):
    with server_sharing_model(server, speculative_config=SPEC, max_num_seqs=8) as s:
        yield s


def _counters(s) -> dict[str, float]:
    port = s.app.metrics.start_http("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        s.app.metrics.stop_http()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("pagedserve:spec_decode")}


def _generate(target: str, **kwargs) -> list[int]:
    from pagedserve_client import PagedServeClient

    with PagedServeClient(target, timeout_s=300) as c:
        return [t for r in c.generate(**kwargs) for t in r.token_ids]


def test_greedy_with_speculation_equals_hf_and_accepts_drafts(spec_server, hf_llm, tokenizer):
    prompts = CHAT_PROMPTS[:3] + QUOTING_PROMPTS
    max_tokens = [24, 24, 24, 32, 40]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_generate, spec_server.target, messages=[("user", p)], temperature=0.0,
                               max_tokens=m, min_tokens=m) for p, m in zip(prompts, max_tokens)]
        ours = [f.result() for f in futures]
    for prompt, m, tokens in zip(prompts, max_tokens, ours):
        ids = chat_ids(tokenizer, prompt)
        with torch.inference_mode():
            ref = hf_llm.generate(torch.tensor([ids]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
        assert tokens == ref[0, len(ids):].tolist(), prompt
    stats = spec_server.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    counters = _counters(spec_server)
    assert counters["pagedserve:spec_decode_num_draft_tokens_total"] == stats["spec_decode_num_draft_tokens"]
    assert counters["pagedserve:spec_decode_num_accepted_tokens_total"] == stats["spec_decode_num_accepted_tokens"]
    assert_no_blocks_held(spec_server)


@pytest.mark.parametrize("constraint", [{"regex": "[A-Za-z ,.']{1,200}"},
                                        {"json_schema": {"type": "object", "properties": {
                                            "sentence": {"type": "string"}}, "required": ["sentence"]}}])
def test_structured_output_with_speculation_equals_plain(server, spec_server, constraint):
    """The grammar mask applies at every draft position: greedy constrained output is the plain server's."""
    kwargs = dict(messages=[("user", QUOTING_PROMPTS[0] + " Answer in JSON with the key sentence.")],
                  temperature=0.0, max_tokens=40, structured_output=constraint)
    before = spec_server.engine.stats()
    assert _generate(spec_server.target, **kwargs) == _generate(server.target, **kwargs)
    after = spec_server.engine.stats()
    assert after["spec_decode_num_draft_tokens"] > before["spec_decode_num_draft_tokens"]  # verified under the mask
    if "regex" in constraint:  # (the JSON answer title-cases the quote, so its drafts are rejected)
        assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert_no_blocks_held(spec_server)
