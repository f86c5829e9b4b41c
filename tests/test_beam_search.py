"""Beam search (issue 20): equality with HF ``generate(num_beams=k)`` on the embedded model (fp32), its blocks
shared copy-on-write (peak memory), preemption and abort, and the parameter checks."""
from __future__ import annotations

import pytest
import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.errors import InvalidInputError
from support import run_to_completion

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
            out.setdefault(d.request_id, {})[d.index] = (d.token_ids, d.finish_reason, d.text, d.cumulative_logprob)
        if on_step is not None:
            on_step(engine)
    return {rid: [v[i] for i in sorted(v)] for rid, v in out.items()}


@pytest.fixture(scope="module")
def chat_prompts(llm_parts):
    from test_generate_e2e import chat_ids

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
