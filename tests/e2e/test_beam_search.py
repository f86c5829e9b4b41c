"""Beam search (issue 20): equality with HF ``generate(num_beams=k)`` on the embedded model (fp32), its blocks
shared copy-on-write (peak memory), preemption and abort, and the parameter checks."""
from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.errors import InvalidInputError
from support import assert_no_blocks_held

pytestmark = pytest.mark.e2e

HF_PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "Say hi.",
]
# (beam_width, n, length_penalty, early_stopping, max_tokens)
HF_CASES = [(2, 1, 1.0, False, 12), (3, 2, 1.0, True, 16), (4, 3, 0.5, False, 10), (4, 4, 2.0, True, 8)]


def beam_params(k: int, n: int = 1, lp: float = 1.0, early: bool = False, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, n=n, beam_search={"beam_width": k, "length_penalty": lp,
                                                             "early_stopping": early}, **kwargs)


def collect(engine, on_step=None) -> dict:
    """Step until idle: {request_id: [(token_ids, finish_reason, text, cumulative_logprob), ...] by index}."""
    out: dict = {}
    while engine.has_unfinished():
        for d in engine.step():
            ids, _, text, _ = out.setdefault(d.request_id, {}).get(d.index, ([], None, "", None))
            out[d.request_id][d.index] = (ids + d.token_ids, d.finish_reason, text + d.text, d.cumulative_logprob)
        if on_step is not None:
            on_step(engine)
    return {rid: [v[i] for i in sorted(v)] for rid, v in out.items()}


@pytest.fixture(scope="module")
def chat_prompts(llm_parts):
    from support import chat_ids

    return [chat_ids(llm_parts[1], p) for p in HF_PROMPTS]


@pytest.mark.parametrize("k,n,lp,early,max_tokens", HF_CASES)
def test_beams_equal_hf_generate(make_engine, hf_llm, llm_parts, chat_prompts, k, n, lp, early, max_tokens):
    """All prompts at once in one engine: the n returned sequences, their order, finish reasons and scores
    (cumulative_logprob / len ** length_penalty) equal HF's sequences and sequences_scores."""
    engine = make_engine(num_kv_blocks=128, max_num_seqs=16)
    eos = sorted(engine.eos_token_ids)
    for i, ids in enumerate(chat_prompts):
        engine.add_request(f"p{i}", ids, beam_params(k, n, lp, early, max_tokens=max_tokens))
    out = collect(engine)
    stopped = 0
    for i, ids in enumerate(chat_prompts):
        hf = hf_llm.generate(torch.tensor([ids]), num_beams=k, num_return_sequences=n, do_sample=False,
                             max_new_tokens=max_tokens, length_penalty=lp, early_stopping=early,
                             eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                             return_dict_in_generate=True)
        assert len(out[f"p{i}"]) == n
        for j, (tokens, reason, text, cum) in enumerate(out[f"p{i}"]):
            hf_tokens = hf.sequences[j, len(ids):].tolist()
            assert hf_tokens[:len(tokens)] == tokens, (i, j)
            assert all(t == eos[0] for t in hf_tokens[len(tokens):]), (i, j)
            ends_with_eos = tokens[-1] in eos
            assert reason == ("stop" if ends_with_eos else "length")
            stopped += ends_with_eos
            assert cum / len(tokens) ** lp == pytest.approx(hf.sequences_scores[j].item(), abs=1e-4)
            assert text == llm_parts[1].decode(tokens[:-1] if ends_with_eos else tokens, skip_special_tokens=True)
    print(f"\nk={k} n={n}: {stopped} of {n * len(chat_prompts)} returned sequences ended with EOS")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_bad_beam_parameters_name_the_field(make_engine):
    cases = [({"temperature": 0.7}, "sampling.temperature"), ({"temperature": 0.0, "n": 3}, "sampling.n"),
             ({"temperature": 0.0, "top_p": 0.9}, "sampling.top_p"),
             ({"temperature": 0.0, "logprobs": 2}, "sampling.logprobs"),
             ({"temperature": 0.0, "repetition_penalty": 1.2}, "sampling.repetition_penalty")]
    for kwargs, field in cases:
        with pytest.raises(InvalidInputError) as e:
            SamplingParams(beam_search={"beam_width": 2}, **kwargs)
        assert e.value.field == field
    for beam, field in [({"beam_width": 1}, "beam_search.beam_width"),
                        ({"beam_width": 2, "length_penalty": float("nan")}, "beam_search.length_penalty"),
                        ({"beam_width": 2, "early_stopping": "yes"}, "beam_search.early_stopping")]:
        with pytest.raises(InvalidInputError) as e:
            SamplingParams(temperature=0.0, beam_search=beam)
        assert e.value.field == field
    engine = make_engine(num_kv_blocks=16, max_num_seqs=4)
    for k, max_tokens in [(8, 4), (4, 200)]:  # more beams than max_num_seqs; blocks for 4 x 200+ tokens
        with pytest.raises(InvalidInputError) as e:
            engine.add_request("bad", [1, 2, 3], beam_params(k, max_tokens=max_tokens))
        assert e.value.field == "beam_search.beam_width"
    assert not engine.has_unfinished() and not engine.groups


# ---- a small random-weight Llama: preemption, abort, memory --------------------------------------------------------


@pytest.fixture(scope="module")
def small_llama(random_llama_model):
    """The shared tiny Llama with a 512-token vocabulary."""
    return random_llama_model(vocab_size=512)


def small_engine(small_llama, **kwargs):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    model, cfg, tokenizer = small_llama
    kwargs = {"device": "cpu", "dtype": "float32", "attention_backend": "torch", "max_model_len": 1024,
              "max_num_seqs": 16, **kwargs}
    return build_engine(EngineConfig(**kwargs), model=model, tokenizer=tokenizer, hf_config=cfg)[0]


def used_blocks(engine) -> int:
    return engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks


def shared_partial_blocks(engine) -> int:
    """Blocks held by two or more beams that are not full of computed tokens (forks of a partial block)."""
    bs, seen = engine.kv_cache.block_size, set()
    for r in engine.scheduler.running:
        for i, b in enumerate(r.blocks):
            if b.ref_cnt > 1 and (i + 1) * bs > r.num_computed_tokens:
                seen.add(b.block_id)
    return len(seen)


def run_small(engine, prompts, widths, max_tokens=12):
    for i, (ids, k) in enumerate(zip(prompts, widths)):
        engine.add_request(f"r{i}", ids, beam_params(k, n=min(k, 2), max_tokens=max_tokens, ignore_eos=True))
    return collect(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_leaves_outputs_identical_and_blocks_free(small_llama, caching):
    """Five beam groups (widths 2-4) under a pool that forces group preemptions (and recomputes of forked
    beams) return what an ample pool returns; every block is free at the end."""
    import random

    rng = random.Random(1)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(9, 30))] for _ in range(5)]
    widths = [2, 3, 4, 3, 4]
    ample = small_engine(small_llama, num_kv_blocks=400, block_size=4, enable_prefix_caching=caching)
    expected = run_small(ample, prompts, widths)
    tight = small_engine(small_llama, num_kv_blocks=44, block_size=4, enable_prefix_caching=caching,
                         max_num_batched_tokens=32, max_model_len=160)
    got = run_small(tight, prompts, widths)
    assert ample.scheduler.num_preemptions == 0 and tight.scheduler.num_preemptions > 0
    assert set(got) == set(expected)
    for rid in expected:
        assert [c[:3] for c in got[rid]] == [c[:3] for c in expected[rid]], rid
        assert [c[3] for c in got[rid]] == pytest.approx([c[3] for c in expected[rid]], abs=1e-4)
    for engine in (ample, tight):
        assert used_blocks(engine) == 0 and not engine.scheduler.running and not engine.groups


def test_abort_mid_search_frees_every_block(small_llama):
    """Abort while beams share partial blocks and groups wait preempted: all blocks free, abort deltas."""
    import random

    rng = random.Random(2)
    engine = small_engine(small_llama, num_kv_blocks=28, block_size=4, max_model_len=100)
    for i in range(4):
        engine.add_request(f"r{i}", [rng.randrange(2, 512) for _ in range(17)],
                           beam_params(4, n=2, max_tokens=10, ignore_eos=True))
    saw_shared = 0
    for _ in range(6):
        engine.step()
        saw_shared = max(saw_shared, shared_partial_blocks(engine))
    assert saw_shared > 0 and used_blocks(engine) > 0
    assert engine.scheduler.num_waiting > 0 and engine.scheduler.num_preemptions > 0
    aborted, deltas = engine.abort(["r0", "r1", "r2", "r3", "nope"])
    assert aborted == ["r0", "r1", "r2", "r3"]
    assert sorted((d.request_id, d.index) for d in deltas) == [(f"r{i}", j) for i in range(4) for j in range(2)]
    assert all(d.finish_reason == "abort" for d in deltas)
    assert used_blocks(engine) == 0 and not engine.has_unfinished() and not engine.groups
    assert engine.scheduler.num_waiting == 0 and not engine.scheduler.running


def test_peak_blocks_share_the_prompt_and_fork_partial_blocks(small_llama):
    """Beam width 4, a 500-token prompt, 64 new tokens (block_size 16): the peak number of blocks held is at most
    prompt blocks + 4 x (output blocks + 1); the baseline is the same 4 sequences run independently."""
    bs, prompt_len, new = 16, 500, 64
    ids = [(7 * i) % 500 + 2 for i in range(prompt_len)]
    peaks = {}
    for mode in ("beam", "independent"):
        engine = small_engine(small_llama, num_kv_blocks=400, block_size=bs, enable_prefix_caching=False)
        if mode == "beam":
            engine.add_request("b", ids, beam_params(4, n=4, max_tokens=new, ignore_eos=True))
        else:
            for i in range(4):
                engine.add_request(f"s{i}", ids, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        peak = [0]
        out = collect(engine, on_step=lambda e: peak.__setitem__(0, max(peak[0], used_blocks(e))))
        assert all(len(c[0]) == new for v in out.values() for c in v)
        assert used_blocks(engine) == 0
        peaks[mode] = peak[0]
    prompt_blocks, out_blocks = -(-prompt_len // bs), -(-new // bs)
    bound = prompt_blocks + 4 * (out_blocks + 1)
    print(f"\npeak KV blocks, beam width 4 (500-token prompt, 64 new, block 16): {peaks['beam']} "
          f"(bound {bound}); 4 independent sequences: {peaks['independent']}")
    assert peaks["beam"] <= bound
    assert peaks["independent"] == 4 * -(-(prompt_len + new - 1) // bs)


def test_stop_strings_and_stop_token_ids_end_single_beams(small_llama):
    """A token the unconstrained search emits becomes a stop string (then a stop token id): the beams that reach it
    become finished hypotheses ("stop", the stop named, the text cut before a stop string), others go on."""
    prompt = [11, 29, 300, 41, 7, 99, 150]
    engine = small_engine(small_llama, num_kv_blocks=200, block_size=4, max_model_len=128)
    engine.add_request("free", prompt, beam_params(3, n=3, max_tokens=8, ignore_eos=True))
    best = collect(engine)["free"][0][0]
    stop_word = small_llama[2].decode([best[2]])
    for kwargs, matched in [({"stop": [stop_word]}, stop_word), ({"stop_token_ids": [best[2]]}, best[2])]:
        engine.add_request("s", prompt, beam_params(3, n=3, max_tokens=8, ignore_eos=True, **kwargs))
        got = []
        while engine.has_unfinished():
            got += engine.step()
        stopped = [d for d in got if d.finish_reason == "stop"]
        assert stopped and all(d.matched_stop == matched for d in stopped), got
        for d in stopped:
            assert stop_word not in d.text
            if "stop_token_ids" in kwargs:
                assert d.token_ids[-1] == best[2] and best[2] not in d.token_ids[:-1]
        assert all(len(d.token_ids) == 8 for d in got if d.finish_reason == "length")
        assert used_blocks(engine) == 0


def test_grpc_beam_search(server, client):
    """Over gRPC: n completions in score order, cumulative_logprob set, usage once; bad fields are
    INVALID_ARGUMENT naming them; the blocks are all free afterwards."""
    import grpc

    from pagedserve_client import pb
    from support import wait_all_blocks_free

    responses = list(client.generate(prompt="The best thing about rain is", max_tokens=6, n=2,
                                     beam_search={"beam_width": 3, "length_penalty": 0.0}))
    assert [r.index for r in responses] == [0, 1]
    assert all(r.HasField("cumulative_logprob") and r.finish_reason != pb.FINISH_REASON_UNSPECIFIED
               for r in responses)
    assert responses[0].cumulative_logprob >= responses[1].cumulative_logprob  # length_penalty 0: raw sums
    assert responses[1].usage.completion_tokens == sum(len(r.token_ids) for r in responses)
    assert not responses[0].HasField("usage")
    for kwargs, field in [(dict(temperature=0.8), "sampling.temperature"), (dict(n=4), "sampling.n"),
                          (dict(beam_search={"beam_width": 1}), "beam_search.beam_width")]:
        kwargs = {"beam_search": {"beam_width": 3}, **kwargs}
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompt="hi", max_tokens=4, **kwargs))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    wait_all_blocks_free(client)


def test_http_use_beam_search_matches_grpc(server, client):
    """vLLM's extras on /v1/completions and /v1/chat/completions: use_beam_search with beam width n; the texts equal
    gRPC's beam search; bad values are 400 naming the field."""
    import httpx

    base = server.http_url + "/v1"
    grpc_texts = [r.text for r in client.generate(prompt="Once upon a time", max_tokens=6, n=3,
                                                  beam_search={"beam_width": 3, "length_penalty": 0.5,
                                                               "early_stopping": True})]
    body = {"prompt": "Once upon a time", "max_tokens": 6, "n": 3, "use_beam_search": True, "length_penalty": 0.5,
            "early_stopping": True}
    r = httpx.post(base + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == grpc_texts
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5, "n": 2, "use_beam_search": True}
    r = httpx.post(base + "/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    for bad, param in [({"n": 1}, "n"), ({"temperature": 0.5}, "temperature"), ({"length_penalty": "x"}, None)]:
        r = httpx.post(base + "/completions", json={**body, **bad}, timeout=60)
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["param"] == param
    assert_no_blocks_held(server)
