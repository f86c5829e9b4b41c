"""Sampler: greedy, seeds, HF agreement of penalties / bias / filters, sampling support and logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedserve.sample.ops.logprobs import compute_logprobs
from pagedserve.sample.ops.penalties import apply_logits_processors
from pagedserve.sample.ops.topk_topp import select_candidates
from pagedserve.sample.sampler import Sampler, SamplingRow, make_generator
from pagedserve.sampling_params import SamplingParams

V = 512
EOS = 7



def filter_mask(logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor | None:
    """``[n, V]`` bool, True where top-k, then top-p, then min-p drop a token (``select_candidates`` as a
    vocabulary mask, to compare with HF's warpers), or None when no filter is given."""
    if top_k is None and top_p is None and min_p is None:
        return None
    n = logits.shape[0]
    _, cand_ids, keep = select_candidates(
        logits, probs, torch.zeros(n, dtype=torch.long) if top_k is None else top_k,
        torch.ones(n) if top_p is None else top_p, torch.zeros(n) if min_p is None else min_p)
    kept = torch.zeros(probs.shape, dtype=torch.int32, device=probs.device).scatter_add_(1, cand_ids, keep.int())
    return kept == 0   # padding entries (token 0, not kept) add nothing

def _row(params: SamplingParams, prompt=(1, 2, 3), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=generator, eos_token_ids=frozenset({EOS}))


def _logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = _logits(8)
    before = logits.clone()
    out = Sampler(seed=0)(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8
    penalized = [_row(SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={3: 2.0}),
                      output=[4, 5]) for _ in range(8)]
    Sampler(seed=0)(logits, penalized)
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy_in_a_mixed_batch():
    logits = _logits(6, seed=1)
    rows = [_row(SamplingParams(top_k=1, temperature=t, seed=s), generator=make_generator(s) if s else None)
            for t, s in [(0.7, None), (1.3, 5), (1.0, None), (2.0, 9), (0.5, None), (1.0, None)]]
    rows[2] = _row(SamplingParams(temperature=0.0))
    rows[5] = _row(SamplingParams(temperature=1.0))  # an unrestricted row in the same batch
    out = Sampler(seed=3)(logits, rows)
    assert out.token_ids[:5] == logits.argmax(-1).tolist()[:5]


def test_seeded_row_is_batch_invariant():
    steps = 25
    per_step = [_logits(1, seed=100 + s, scale=1.0)[0] for s in range(steps)]
    noise = [_logits(5, seed=200 + s, scale=1.0) for s in range(steps)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(position: int, batch_size: int, others_seeded: bool, sampler_seed: int) -> list[int]:
        gen = make_generator(1234)
        other_gens = [make_generator(77 + j) for j in range(batch_size)]
        sampler, out = Sampler(seed=sampler_seed), []
        for s in range(steps):
            logits = noise[s][:batch_size].clone()
            logits[position] = per_step[s]
            rows = [_row(SamplingParams(temperature=0.8 + 0.1 * j, top_k=j, min_p=0.01 * j, presence_penalty=0.5),
                         output=[j, 3], generator=other_gens[j] if others_seeded else None)
                    for j in range(batch_size)]
            rows[position] = _row(params, generator=gen)
            out.append(sampler(logits, rows).token_ids[position])
        return out

    alone = run(0, 1, False, 0)
    assert run(3, 5, False, 1) == alone
    assert run(1, 4, True, 2) == alone
    assert len(set(alone)) > 5  # really sampled, not greedy
    other_seed = []
    gen = make_generator(4321)
    for s in range(steps):
        other_seed.append(Sampler(seed=0)(per_step[s][None], [_row(params, generator=gen)]).token_ids[0])
    assert other_seed != alone


def _hf_reference(logits_row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Our documented order built from transformers' processors (+ the OpenAI formula, which HF does not have)."""
    scores = logits_row[None].clone()
    ids = torch.tensor([prompt + output])
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in p.logit_bias])(ids, scores)
    if p.min_tokens:
        stop = list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stop)(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    for t in set(output):  # OpenAI: mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence
        scores[0, t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    return scores[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processors_match_transformers(seed):
    g = torch.Generator().manual_seed(seed)
    cases = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, presence_penalty=0.4),
        SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0),
        SamplingParams(logit_bias={5: 3.5, 11: -100.0, EOS: 50.0}, min_tokens=30, stop_token_ids=(9,)),
        SamplingParams(min_tokens=30, ignore_eos=True, stop_token_ids=(9, 10)),
        SamplingParams(min_tokens=2, repetition_penalty=1.1, frequency_penalty=0.3, logit_bias=[(5, 1.0)]),
        SamplingParams(),
    ]
    rows, refs = [], []
    logits = _logits(len(cases), seed=seed)
    for i, p in enumerate(cases):
        prompt = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, 40, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
        rows.append(_row(p, prompt=prompt, output=output))
        refs.append(_hf_reference(logits[i], p, prompt, output))
    got = apply_logits_processors(logits, rows)
    torch.testing.assert_close(got, torch.stack(refs), rtol=0, atol=1e-5)
    assert got[4, EOS] == logits[4, EOS] and got[4, 9] == -math.inf  # ignore_eos: EOS not masked
    assert got[3, EOS] == -math.inf  # min_tokens beats a positive bias


def _drop_mask(logits: torch.Tensor, settings) -> torch.Tensor:
    top_k = torch.tensor([k for k, _, _ in settings])
    top_p = torch.tensor([p for _, p, _ in settings])
    min_p = torch.tensor([m for _, _, m in settings])
    return filter_mask(logits, logits.softmax(-1), top_k, top_p, min_p)


@pytest.mark.parametrize("vocab_size", [V, 3000])
def test_filters_match_transformers_warpers(vocab_size, monkeypatch):
    # few candidates, so that both the top-k candidate path and the full-sort fallback of top-p run
    monkeypatch.setattr("pagedserve.sample.ops.topk_topp._MIN_CANDIDATES", 16)
    settings = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (20, 0.6, 0.05), (3, 0.3, 0.5),
                (vocab_size + 50, 0.95, 0.0), (0, 0.999, 0.02), (0, 0.97, 0.0), (200, 0.99, 0.0), (1, 0.5, 0.9)]
    logits = _logits(len(settings), vocab_size, seed=4) / torch.linspace(0.3, 2.0, len(settings)).unsqueeze(1)
    drop = _drop_mask(logits, settings)
    for i, (k, p, m) in enumerate(settings):
        ref = logits[i:i + 1].clone()
        ids = torch.zeros(1, 1, dtype=torch.long)
        if k:
            ref = TopKLogitsWarper(min(k, vocab_size))(ids, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(ids, ref)
        if m > 0.0:
            ref = MinPLogitsWarper(m)(ids, ref)
        assert torch.equal(~drop[i], torch.isfinite(ref[0])), settings[i]
    assert int((~drop[8]).sum()) > 64  # this row needed the full-sort fallback


def test_temperature_matches_transformers():
    logits = _logits(1, seed=5)
    p = SamplingParams(temperature=0.37, top_k=V)
    ref = TemperatureLogitsWarper(0.37)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    assert torch.equal(logits / torch.tensor([[p.temperature]]), ref)


@pytest.mark.parametrize("params", [SamplingParams(top_k=6), SamplingParams(top_p=0.5),
                                    SamplingParams(min_p=0.3), SamplingParams(top_k=10, top_p=0.7, min_p=0.2,
                                                                              temperature=1.5)])
def test_samples_stay_in_the_allowed_set_with_the_right_frequencies(params):
    n, v = 4000, 32
    base = torch.randn(v, generator=torch.Generator().manual_seed(6)) * 1.5
    logits = base.expand(n, v).contiguous()
    scaled = (base / params.temperature)[None]
    allowed = ~_drop_mask(scaled, [(params.top_k, params.top_p, params.min_p)])[0]
    expected = scaled[0].masked_fill(~allowed, -math.inf).softmax(-1)
    assert 1 < int(allowed.sum()) < v
    tokens = torch.tensor(Sampler(seed=11)(logits, [_row(params) for _ in range(n)]).token_ids)
    assert bool(allowed[tokens].all())
    freq = torch.bincount(tokens, minlength=v).double() / n
    sigma = (expected.double() * (1 - expected.double()) / n).sqrt()
    assert bool(((freq - expected.double()).abs() <= 5 * sigma + 1e-9).all()), (freq, expected)


def test_logprobs_are_raw_sorted_and_consistent():
    logits = _logits(5, seed=7)
    params = [SamplingParams(logprobs=5, top_p=0.5, top_k=3, seed=1), SamplingParams(logprobs=0),
              SamplingParams(logprobs=20, temperature=0.0, repetition_penalty=2.0),
              SamplingParams(), SamplingParams(logprobs=1, temperature=2.5, presence_penalty=-2.0)]
    rows = [_row(p, output=[1, 2, 2], generator=make_generator(p.seed) if p.seed is not None else None)
            for p in params]
    out = Sampler(seed=8)(logits, rows)
    raw = logits.log_softmax(-1)
    assert out.logprobs[3] is None
    for i, p in enumerate(params):
        entry = out.logprobs[i]
        if p.logprobs is None:
            continue
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(float(raw[i, entry.token_id]), abs=1e-6)
        assert entry.rank == 1 + int((raw[i] > raw[i, entry.token_id]).sum())
        assert len(entry.top) == p.logprobs
        values = [lp for _, lp in entry.top]
        assert all(math.isfinite(x) for x in values) and values == sorted(values, reverse=True)
        assert [t for t, _ in entry.top] == raw[i].topk(p.logprobs).indices.tolist()
        for t, lp in entry.top:
            if t == entry.token_id:
                assert lp == entry.logprob and entry.rank == [t2 for t2, _ in entry.top].index(t) + 1


def test_compute_logprobs_for_prompt_positions():
    logits = _logits(4, seed=9)
    entries = compute_logprobs(logits, [3, 1, 4, 1], [2, 2, 2, 2])
    raw = logits.log_softmax(-1)
    assert [e.token_id for e in entries] == [3, 1, 4, 1]
    assert [e.logprob for e in entries] == pytest.approx([float(raw[i, t]) for i, t in enumerate([3, 1, 4, 1])])


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        Sampler()(_logits(2), [_row(SamplingParams())])
