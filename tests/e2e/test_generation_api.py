"""The Generate API's semantics over gRPC (API.md): logprobs, prompt logprobs, n, seeds, finish reasons, usage."""
from __future__ import annotations

import concurrent.futures
import math

import pytest
import torch

from pagedserve_client import pb

pytestmark = pytest.mark.e2e


def run(client, **kw) -> list:
    return list(client.generate(**kw))


def by_index(msgs) -> dict[int, list]:
    out: dict[int, list] = {}
    for m in msgs:
        out.setdefault(m.index, []).append(m)
    return out


def test_logprobs_are_well_formed(client):
    for extra in ({}, {"top_p": 0.8, "top_k": 20, "temperature": 0.7, "seed": 3}):
        msgs = run(client, prompt="The weather today is", max_tokens=12, logprobs=5, **extra)
        entries = [lp for m in msgs for lp in m.logprobs]
        assert len(entries) == sum(len(m.token_ids) for m in msgs) == 12
        for m in msgs:
            assert [lp.token_id for lp in m.logprobs] == list(m.token_ids)
        for lp in entries:
            tops = [t.logprob for t in lp.top_logprobs]
            assert len(tops) == 5 and all(math.isfinite(x) and x <= 0 for x in tops)
            assert tops == sorted(tops, reverse=True) and [t.rank for t in lp.top_logprobs] == [1, 2, 3, 4, 5]
            assert math.isfinite(lp.logprob) and lp.rank >= 1
            match = [t for t in lp.top_logprobs if t.token_id == lp.token_id]
            if match:
                assert abs(match[0].logprob - lp.logprob) < 1e-6 and match[0].rank == lp.rank


def test_greedy_logprob_is_rank_one(client):
    msgs = run(client, prompt="One, two, three,", max_tokens=6, temperature=0.0, logprobs=1)
    assert all(lp.rank == 1 and lp.top_logprobs[0].token_id == lp.token_id for m in msgs for lp in m.logprobs)


def test_prompt_logprobs_match_hf(client, hf_llm, tokenizer):
    prompt = "Paged attention stores the key value cache in fixed size blocks."
    ids = tokenizer.encode(prompt)
    msgs = run(client, prompt=prompt, max_tokens=1, prompt_logprobs=2)
    plps = list(msgs[0].prompt_logprobs)
    assert len(plps) == len(ids) - 1 and [p.token_id for p in plps] == ids[1:]
    with torch.inference_mode():
        ref = hf_llm(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for i, p in enumerate(plps):
        assert abs(p.logprob - ref[i, ids[i + 1]].item()) < 1e-4
        assert len(p.top_logprobs) == 2 and p.top_logprobs[0].token_id == int(ref[i].argmax())


def test_max_tokens_one_and_length_semantics(client):
    msgs = run(client, prompt="Hello", max_tokens=1, ignore_eos=True)
    assert sum(len(m.token_ids) for m in msgs) == 1
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 1
    # A natural stop (EOS) is STOP with the EOS id as matched_stop, never LENGTH.
    msgs = run(client, messages=[("user", "Say only the word yes.")], max_tokens=60, temperature=0.0)
    n = sum(len(m.token_ids) for m in msgs)
    assert msgs[-1].finish_reason == (pb.FINISH_REASON_LENGTH if n == 60 else pb.FINISH_REASON_STOP)
    if msgs[-1].finish_reason == pb.FINISH_REASON_STOP:
        assert msgs[-1].WhichOneof("matched_stop") == "matched_stop_token_id"
        assert msgs[-1].token_ids[-1] == msgs[-1].matched_stop_token_id
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])


def test_usage_counts_equal_streamed_tokens(client, tokenizer):
    msgs = run(client, prompt="Tell me about the moon.", max_tokens=20, n=3, temperature=0.8, seed=11)
    groups = by_index(msgs)
    assert sorted(groups) == [0, 1, 2]
    usage = [m for m in msgs if m.HasField("usage")]
    assert len(usage) == 1 and usage[0] is msgs[-1]
    assert usage[0].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
    assert usage[0].usage.prompt_tokens == len(tokenizer.encode("Tell me about the moon."))


def test_seed_reproducible_alone_and_beside_other_requests(client):
    kw = dict(prompt="My favourite animal is", max_tokens=16, temperature=1.0, seed=42)
    alone = [t for m in run(client, **kw) for t in m.token_ids]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(run, client, **kw)]
        futs += [pool.submit(run, client, prompt=f"Noise {i}", max_tokens=16, temperature=1.0) for i in range(3)]
        futs += [pool.submit(run, client, prompt="Other seeded", max_tokens=16, temperature=1.0, seed=7)]
        beside = [t for m in futs[0].result() for t in m.token_ids]
        [f.result() for f in futs[1:]]
    assert alone == beside
    n_a = by_index(run(client, **{**kw, "n": 3}))
    n_b = by_index(run(client, **{**kw, "n": 3}))
    toks = lambda g: {i: [t for m in ms for t in m.token_ids] for i, ms in g.items()}  # noqa: E731
    assert toks(n_a) == toks(n_b)
    assert len({tuple(v) for v in toks(n_a).values()}) > 1   # the n completions differ from each other


def test_include_stop_str_in_output(client):
    base = "".join(m.text for m in run(client, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0.0,
                                       ignore_eos=True))
    msgs = run(client, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0.0, stop=[" 8"],
               include_stop_str_in_output=True)
    text = "".join(m.text for m in msgs)
    assert text == base[:base.index(" 8") + 2] and msgs[-1].matched_stop_str == " 8"


def test_tokenize_and_detokenize(client, tokenizer):
    resp = client.tokenize("Hello world")
    assert list(resp.token_ids) == tokenizer.encode("Hello world")
    assert client.detokenize(list(resp.token_ids)) == "Hello world"
    chat = client.tokenize(messages=[("user", "Hi")])
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert list(chat.token_ids) == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    ids = list(range(1000, 1050))
    full = run(client, prompt_token_ids=ids[-10:], max_tokens=5, temperature=0.0, ignore_eos=True)
    cut = run(client, prompt_token_ids=ids, max_tokens=5, temperature=0.0, ignore_eos=True,
              truncate_prompt_tokens=10)
    assert [t for m in full for t in m.token_ids] == [t for m in cut for t in m.token_ids]
    assert cut[-1].usage.prompt_tokens == 10
