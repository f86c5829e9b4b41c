"""Speculative decoding (n-gram drafts): the proposer, the config, verification in the sampler (chi-square against
the target distribution), and engine-level exactness on a small random-weight Llama: greedy and seeded outputs
equal plain decoding's, stops inside an accepted run, sampling options at every verified position, preemption and
abort with drafts in flight, and a KV property test with draft slots and rollback."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy.stats import chisquare

from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sample.rejection_sampler import RejectionSampler
from pagedserve.sample.sampler import Sampler, SamplingRow, make_generator
from pagedserve.sampling_params import SamplingParams
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.spec_decode import NgramProposer
from sched_cases import schedule
from support import run_to_completion

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": null}'


# ---- proposer ---------------------------------------------------------------------------------------------------
def test_longest_matching_suffix_wins_then_the_most_recent_occurrence():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    # suffix "2 3": "1 2 3" occurs nowhere before, "2 3" at 1-2 (then 4) and 6-7 (then 5): most recent wins
    assert p.propose_one([1, 2, 3, 4, 9, 9, 2, 3, 5, 6, 2, 3], 3) == [5, 6, 2]
    # suffix "7 2 3" (length 3) at 0-2 beats the more recent "2 3" at 5-6
    assert p.propose_one([7, 2, 3, 8, 8, 2, 3, 9, 7, 2, 3], 3) == [8, 8, 2]
    assert p.propose_one([5, 6, 7, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]          # max_drafts bounds the drafts
    assert p.propose_one([5, 6, 7, 1, 2, 3, 8, 1, 2, 3], 0) == []
    assert p.propose([[1, 2, 1, 2, 3, 4, 5, 6, 1, 2]], [10]) == [[3, 4, 5]]   # num_speculative_tokens bounds too
    assert p.propose_one([4, 1, 1, 1], 3) == [1]                               # overlapping match; context ends
    assert p.propose_one([1, 2, 3], 3) == [] and p.propose_one([7], 3) == [] and p.propose_one([], 3) == []


def test_prompt_lookup_min_and_max_bound_the_match():
    ctx = [9, 1, 2, 3, 4, 8, 1, 2, 3]
    assert NgramProposer(2, 3, 3).propose_one(ctx, 2) == [4, 8]
    assert NgramProposer(2, 4, 4).propose_one(ctx, 2) == []                   # "8 1 2 3" occurs only at the end
    assert NgramProposer(2, 2, 1).propose_one(ctx, 2) == [4, 8]               # capped at 2, still found
    assert NgramProposer(2, 3, 2).propose_one([5, 6, 1, 7, 1], 2) == []        # only a 1-gram matches
    assert NgramProposer(2, 3, 1).propose_one([5, 6, 1, 7, 1], 2) == [7, 1]
    with pytest.raises(ValueError):
        NgramProposer(2, 1, 2)


def test_speculative_config_parses_and_checks():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative()
    assert cfg == SpeculativeConfig(num_speculative_tokens=3) and cfg.rejection_backoff_max == 16
    assert SpeculativeConfig.from_json('{"prompt_lookup_min": 6}').prompt_lookup_max == 6
    assert EngineConfig().speculative() is None
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"num_speculative_tokens": 99}',
                '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', '{"unknown": 1}', '[1]', 'not json',
                '{"disable_by_batch_size": 0}', '{"num_speculative_tokens": true}', '{"rejection_backoff_max": -1}'):
        with pytest.raises(ValueError, match="speculative_config"):
            EngineConfig(speculative_config=bad)


# ---- verification in the sampler ----------------------------------------------------------------------------------
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 1.2])


def _slot(kv: KVCacheManager, request: Request, position: int) -> int:
    """Cache slot of the token at ``position``: ``block_id * block_size + position % block_size``."""
    return request.blocks[position // kv.block_size].block_id * kv.block_size + position % kv.block_size


def _target(params: SamplingParams) -> torch.Tensor:
    logits = LOGITS.double() / params.temperature
    if params.top_k:
        logits = logits.masked_fill(logits < logits.topk(params.top_k).values[-1], float("-inf"))
    return logits.softmax(-1)


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("params,draft", [(SamplingParams(temperature=1.0), 1),
                                          (SamplingParams(temperature=0.7, top_k=5), 7),
                                          (SamplingParams(temperature=1.0), 5)])   # a draft of low probability
def test_first_token_after_a_forced_draft_follows_the_target_distribution(params, draft, seeded):
    """4000 requests, each with the forced draft ``draft``: the first emitted token (the draft when accepted, else
    the resample) is distributed as the target p (chi-square, fixed seeds); the draft is accepted with
    probability p(draft); the resamples follow p without the draft."""
    n = 4000
    p = _target(params)
    rows = []
    for i in range(n):
        gen = make_generator(1000 + i) if seeded else None
        rows += [SamplingRow(params, [3], [], generator=gen), SamplingRow(params, [3], [draft], generator=gen)]
    out = RejectionSampler(Sampler(seed=1234)).verify(LOGITS.repeat(2 * n, 1), rows, [[draft]] * n)
    first = torch.tensor([t[0] for t in out.token_ids])
    counts = torch.bincount(first, minlength=8).double()
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support] / p[support].sum() * counts.sum()
    assert chisquare(counts[support], expected).pvalue > 1e-3
    accepted = torch.tensor(out.num_accepted)
    assert abs(accepted.double().mean() - p[draft]) < 4 * (p[draft] * (1 - p[draft]) / n).sqrt() + 1e-9
    assert all(len(t) == 1 + a for t, a in zip(out.token_ids, out.num_accepted))
    rejected = first[accepted == 0]
    residual = p.clone()
    residual[draft] = 0
    residual = residual / residual.sum()
    rc = torch.bincount(rejected, minlength=8).double()
    keep = residual > 0
    assert rc[draft] == 0
    assert chisquare(rc[keep], residual[keep] / residual[keep].sum() * rc.sum()).pvalue > 1e-3


def test_verify_greedy_accepts_while_the_draft_is_the_argmax_and_seeded_equals_plain_steps():
    greedy = SamplingParams(temperature=0.0)
    logits = torch.stack([LOGITS, LOGITS.roll(1), LOGITS.roll(2), LOGITS.roll(3)])  # argmaxes 0, 1, 2, 3
    rows = [SamplingRow(greedy, [3], [0, 1, 9][:j]) for j in range(4)]
    out = RejectionSampler(Sampler(seed=0)).verify(logits, rows, [[0, 1, 9]])
    assert out.token_ids == [[0, 1, 2]] and out.num_accepted == [2]
    # seeded: the tokens equal those of plain steps drawing from the same generator, whatever the drafts
    params = SamplingParams(temperature=1.0, seed=5)
    plain_gen, spec_gen = make_generator(5), make_generator(5)
    plain = [Sampler(seed=0)(logits[j:j + 1], [SamplingRow(params, [3], [], generator=plain_gen)]).token_ids[0]
             for j in range(2)]
    drafts = [plain[0]]
    rows = [SamplingRow(params, [3], [], generator=spec_gen), SamplingRow(params, [3], drafts, generator=spec_gen)]
    assert RejectionSampler(Sampler(seed=0)).verify(logits[:2], rows, [drafts]).token_ids == [plain]


# ---- engine level, small random-weight Llama ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(random_llama_model):
    """The shared tiny Llama with a 64-token vocabulary: random prompts repeat, so n-gram drafts get accepted."""
    return random_llama_model(vocab_size=64)


def _engine(tiny, spec, num_kv_blocks=96, max_model_len=256, **kw):
    from pagedserve.engine.builder import build_engine

    model, cfg, tok = tiny
    config = EngineConfig(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=num_kv_blocks,
                          block_size=4, max_model_len=max_model_len, speculative_config=spec, **kw)
    return build_engine(config, model=model, tokenizer=tok, hf_config=cfg)[0]


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 64) for _ in range(rng.randint(5, 20))] * 2 for _ in range(n)]


def _run(tiny, spec, params, prompts=None, eos=None, **kw):
    engine = _engine(tiny, spec, **kw)
    if eos is not None:
        engine.eos_token_ids = frozenset([eos])
    prompts = prompts or _prompts()
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, per_request)):
        engine.add_request(f"r{i}", p, sp)
    multi: dict[str, list[int]] = {}   # request -> sizes of its deltas (a size > 1: an accepted run)

    def watch(_, deltas):
        for d in deltas:
            multi.setdefault(d.request_id, []).append(len(d.token_ids))
    out = run_to_completion(engine, watch)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return out, engine, multi


def test_greedy_with_drafts_equals_plain_decoding_and_drafts_are_accepted(tiny):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, e0, _ = _run(tiny, None, params)
    spec, e1, multi = _run(tiny, SPEC, params)
    assert spec == plain
    assert e1.drafter.num_accepted_tokens > 0 and e1.num_steps < e0.num_steps
    stats = e1.stats()
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"] > 0
    assert any(size > 1 for sizes in multi.values() for size in sizes)


@pytest.mark.parametrize("options", [
    dict(temperature=0.8, seed=5),
    dict(temperature=0.05, seed=7, logprobs=3),
    dict(temperature=0.3, seed=9, top_k=8, top_p=0.9, min_p=0.05),
    dict(temperature=0.0, repetition_penalty=1.2, logit_bias={5: 3.0, 9: -2.0}, min_tokens=30, logprobs=2),
    dict(temperature=0.2, seed=3, frequency_penalty=0.3, presence_penalty=0.2)])
def test_sampling_options_apply_at_every_verified_position(tiny, options):
    """Seeded sampling draws the same uniforms per emitted token with and without drafts, and every option is
    applied at each verified position as at a plain step: the outputs are identical."""
    params = SamplingParams(max_tokens=32, ignore_eos=True, **options)
    plain, _, _ = _run(tiny, None, params)
    spec, e1, _ = _run(tiny, SPEC, params)
    assert spec == plain
    assert e1.drafter.num_draft_tokens > 0


def _stop_cases(tiny):
    """Greedy spec run: for each request, a position inside an accepted run (not its last token)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out, _, multi = _run(tiny, SPEC, params)
    cases = []
    for rid, sizes in multi.items():
        tokens, pos = out[rid][0][0], 0
        for size in sizes:
            # the run's second token (later ones would follow); not t0/t1 (unk/EOS: special, not in the text)
            if size > 2 and min(tokens[pos], tokens[pos + 1]) > 1:
                cases.append((rid, tokens, pos + 1))
                break
            pos += size
    assert len(cases) >= 3
    return cases


def test_stops_eos_and_max_tokens_inside_an_accepted_run_end_where_plain_decoding_does(tiny):
    prompts = _prompts()
    for rid, tokens, pos in _stop_cases(tiny):
        idx = int(rid[1:])
        prompt = [prompts[idx]]
        stop_tok = tokens[pos]
        first = tokens.index(stop_tok)   # the stop fires at its first occurrence
        variants = [
            (dict(stop_token_ids=[stop_tok], ignore_eos=True), None, first + 1, "stop"),
            (dict(), stop_tok, first + 1, "stop"),                             # the token is EOS
            (dict(ignore_eos=True, max_tokens=pos + 1), None, pos + 1, "length"),
            (dict(ignore_eos=True, stop=[f"t{tokens[pos - 1]} t{stop_tok}"]), None, None, "stop"),
        ]
        for kw, eos, length, reason in variants:
            params = SamplingParams(**{"max_tokens": 40, "temperature": 0.0, **kw})
            plain, _, _ = _run(tiny, None, params, prompt, eos=eos)
            spec, _, _ = _run(tiny, SPEC, params, prompt, eos=eos)
            assert spec == plain, kw
            ids, finish, _ = spec["r0"][0]
            assert finish == reason, kw
            if length is not None:
                assert len(ids) == length, kw


def test_preemption_with_drafts_in_flight_keeps_outputs_and_frees_every_block(tiny):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = _prompts(10, seed=3)
    big, _, _ = _run(tiny, None, params, prompts, num_kv_blocks=400)
    small, e, _ = _run(tiny, SPEC, params, prompts, num_kv_blocks=30, max_model_len=120)
    assert small == big
    assert e.scheduler.num_preemptions > 0 and e.drafter.num_accepted_tokens > 0


def test_abort_with_drafts_in_flight_frees_every_block(tiny):
    engine = _engine(tiny, SPEC)
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for _ in range(40):
        engine.step()
        if any(n > 1 for n in engine.last_step_composition.values()) and \
                any(r.spec_token_ids for r in engine.scheduler.running):
            break
    assert engine.drafter.num_draft_tokens > 0
    engine.abort([f"r{i}" for i in range(6)])
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_large_batches_step_aside(tiny):
    """disable_by_batch_size 3: no drafts while 3 or more run; the tail (two long requests left) speculates."""
    spec = SPEC.replace('"disable_by_batch_size": null', '"disable_by_batch_size": 3')
    engine = _engine(tiny, spec)
    for i, (p, m) in enumerate(zip(_prompts(4), (6, 8, 40, 40))):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    while len(engine.scheduler.running) + engine.scheduler.num_waiting >= 3:
        engine.step()
        assert engine.drafter.num_draft_tokens == 0
    run_to_completion(engine)
    assert engine.drafter.num_draft_tokens > 0


def test_all_rejected_drafts_back_off_and_outputs_are_unchanged(tiny):
    """rejection_backoff_max: after an all-rejected verification a request skips 1, 2, 4... steps of drafts (capped),
    an accepted draft resets it; greedy outputs equal those of speculation without backoff and of plain decoding,
    with fewer rejected drafts."""
    from types import SimpleNamespace

    engine = _engine(tiny, SPEC.replace("}", ', "rejection_backoff_max": 5}'))
    req = SimpleNamespace(spec_backoff=0, spec_skip=0)
    seen = []
    for accepted in (0, 0, 0, 0, 0, 2, 0):
        engine.drafter.backoff(req, accepted)
        seen.append((req.spec_backoff, req.spec_skip))
    assert seen == [(1, 1), (2, 2), (4, 4), (5, 5), (5, 5), (0, 0), (1, 1)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _, _ = _run(tiny, None, params)
    always, e0, _ = _run(tiny, SPEC.replace("}", ', "rejection_backoff_max": 0}'), params)
    backoff, e1, _ = _run(tiny, SPEC, params)
    assert backoff == always == plain
    assert e1.drafter.num_accepted_tokens > 0
    assert e1.drafter.num_draft_tokens - e1.drafter.num_accepted_tokens < e0.drafter.num_draft_tokens - e0.drafter.num_accepted_tokens


# ---- KV property test with draft slots and rollback ---------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=40),
       st.booleans())
def test_draft_slots_and_rollback_keep_kv_invariants(ops, caching):
    """Random requests decode with random drafts and random acceptance through the real scheduler: ref counts
    match the block tables; every computed position's KV slot holds that position's (verified) token; every
    prefix-cached block holds exactly its hashed tokens (rejected drafts' KV never reaches the cache); a rolled
    back request holds only the blocks its tokens need; everything is free at the end."""
    bs = 4
    kv = KVCacheManager(num_blocks=24, block_size=bs, enable_prefix_caching=caching)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=24)
    slots: dict[int, int] = {}     # slot -> token whose KV was last written there
    rng = random.Random(len(ops))
    counter = 0
    for num_drafts, accept, new in ops:
        for _ in range(new % 3 == 0):
            counter += 1
            prompt = [counter % 3] * 6 + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            sched.add_request(Request(f"r{counter}", prompt, SamplingParams(), 64, frozenset()))
        for r in sched.running:
            r.spec_token_ids = [rng.randrange(50) for _ in range(num_drafts)]
        out = schedule(sched)
        for e in out.scheduled:   # the forward: write each computed position's input token into its slot
            r, start = e.request, e.request.num_computed_tokens
            inputs = (r.token_ids[start:] + e.draft_token_ids)[:e.num_new_tokens]
            for j, t in enumerate(inputs):
                slots[_slot(kv, r, start + j)] = t
        for e in out.scheduled:   # what update_from_output does first
            e.request.num_computed_tokens += e.num_new_tokens
        for e in out.scheduled:
            if not e.samples:
                continue
            r, drafts = e.request, e.draft_token_ids
            a = min(accept, len(drafts))
            for t in drafts[:a] + [rng.randrange(50, 60)]:   # accepted drafts, then a token no draft had
                r.append_output_token(t)
            if drafts:
                sched.rollback_drafts(r)
                assert r.num_computed_tokens == r.num_tokens - 1
                assert len(r.blocks) <= max(kv.blocks_needed(r.num_tokens), r.num_registered_blocks)
            if r.num_output_tokens >= 20:
                sched.finish(r, r.status.FINISHED_LENGTH)
        live = sched.running
        holders: dict[int, int] = {}
        for r in live:
            for b in r.blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
            for pos in range(r.num_computed_tokens):
                assert slots[_slot(kv, r, pos)] == r.token_ids[pos]
        for b in kv.pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0)
            if b.block_hash is not None:
                assert tuple(slots.get(b.block_id * bs + i) for i in range(bs)) == b.token_ids
    for r in list(sched.running):
        sched.finish(r, r.status.FINISHED_ABORTED)
    for r in sched.waiting():
        sched.finish(r, r.status.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_blocks
