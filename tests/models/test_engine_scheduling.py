"""Engine-level scheduling on the real model: preemption, chunked prefill, prefix caching, n > 1 block sharing."""
from __future__ import annotations

import math
import random

from pagedserve.sampling_params import SamplingParams

from support import run_to_completion


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tokens_of(out) -> dict:
    return {rid: [c[0] for _, c in sorted(v.items())] for rid, v in out.items()}


def test_preemption_keeps_outputs_identical(make_engine):
    """32 concurrent greedy requests in a 24-block pool: all finish, preemptions happen, outputs equal a run whose
    pool holds them all."""
    rng = random.Random(7)
    # Lengths drawn log-uniformly (20..400 prompt tokens, 16..64 new tokens): a few long requests among many short
    # ones, which keeps the 24-block run's step count (and the suite's time) moderate.
    log_uniform = lambda lo, hi: int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))  # noqa: E731
    prompts = [[rng.randrange(100, 49000) for _ in range(log_uniform(20, 400))] for _ in range(32)]
    max_tokens = [log_uniform(16, 64) for _ in prompts]
    assert max(map(len, prompts)) > 250 and min(map(len, prompts)) < 40

    def run(num_blocks):
        engine = make_engine(block_size=32, num_kv_blocks=num_blocks, max_num_seqs=32, max_num_batched_tokens=1024)
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            engine.add_request(f"r{i}", p, greedy(m))
        out = run_to_completion(engine)
        assert engine.kv_cache.num_free_blocks == num_blocks
        return engine, out

    small, out_small = run(24)
    big, out_big = run(800)
    assert small.scheduler.num_preemptions > 0 and big.scheduler.num_preemptions == 0
    assert len(out_small) == 32
    for i, m in enumerate(max_tokens):
        ids, reason, _ = out_small[f"r{i}"][0]
        assert len(ids) == m and reason == "length"
    assert tokens_of(out_small) == tokens_of(out_big)


def test_chunked_prefill_matches_unchunked_and_decodes_keep_going(make_engine):
    long_prompt = random_prompts(1, 3000, 3000, seed=2)[0]
    short = random_prompts(2, 30, 40, seed=3)

    def run(budget, watch):
        engine = make_engine(max_num_batched_tokens=budget, num_kv_blocks=400)
        for i, p in enumerate(short):
            engine.add_request(f"s{i}", p, greedy(40))
        engine.step()                                  # the short ones prefill and start decoding
        engine.add_request("long", long_prompt, greedy(8))
        compositions = []

        def on_step(eng, _):
            compositions.append(eng.last_step_composition)
        out = run_to_completion(engine, on_step if watch else None)
        return out, compositions

    chunked, compositions = run(256, True)
    whole, _ = run(4096, False)
    assert tokens_of(chunked) == tokens_of(whole)
    prefill_steps = [c for c in compositions if c.get("long", 0) > 1]
    assert len(prefill_steps) >= 3000 // 256
    for c in prefill_steps:                           # the short ones have 40 tokens to make: they outlast it
        assert sum(c.values()) <= 256
        assert c.get("s0") == 1 and c.get("s1") == 1   # each running decode produced a token in this step


def test_prefix_caching_on_off_cold_warm_and_after_eviction(make_engine):
    system = random_prompts(1, 1000, 1000, seed=4)[0]
    questions = random_prompts(3, 20, 30, seed=5)
    filler = random_prompts(6, 300, 400, seed=6)

    def run(enable):
        engine = make_engine(enable_prefix_caching=enable, num_kv_blocks=200)
        results = []
        engine.add_request("cold", system + questions[0], greedy(16))
        results.append(run_to_completion(engine))
        hits_before = engine.kv_cache.stats.hits_tokens
        engine.add_request("warm", system + questions[1], greedy(16))
        computed = []
        results.append(run_to_completion(
            engine, lambda e, _: computed.append(e.last_step_composition.get("warm", 0))))
        warm_hits = engine.kv_cache.stats.hits_tokens - hits_before
        for i, f in enumerate(filler):                # enough traffic to evict the cached system prompt
            engine.add_request(f"fill{i}", f, greedy(4))
        run_to_completion(engine)
        engine.add_request("evicted", system + questions[2], greedy(16))
        results.append(run_to_completion(engine))
        return results, warm_hits, sum(computed)

    on, warm_hits, computed_on = run(True)
    off, no_hits, computed_off = run(False)
    assert [tokens_of(r) for r in on] == [tokens_of(r) for r in off]
    prompt_len = 1000 + len(questions[1])
    assert warm_hits >= 992 and no_hits == 0
    # With the cache the warm request computes only its new tokens (its 16 outputs after the first come on top).
    assert computed_on == prompt_len - warm_hits + 15
    assert computed_off == prompt_len + 15


def test_n_completions_share_prompt_blocks(make_engine):
    prompt = random_prompts(1, 100, 100, seed=8)[0]
    for enable in (True, False):
        engine = make_engine(enable_prefix_caching=enable, num_kv_blocks=100, block_size=16)
        engine.add_request("one", prompt, greedy(12))
        single = run_to_completion(engine)["one"][0][0]
        engine.add_request("four", prompt, greedy(12, n=4))
        max_shared = []

        def on_step(eng, _):
            refs = [b.ref_cnt for b in eng.kv_cache.pool.blocks]
            max_shared.append(max(refs))
        out = run_to_completion(engine, on_step)["four"]
        assert sorted(out) == [0, 1, 2, 3]
        assert all(out[i][0] == single for i in range(4))
        assert max(max_shared) == 4                    # the prompt's full blocks are held by all four
        assert engine.kv_cache.num_free_blocks == 100


def test_aborting_an_n_request_before_its_prompt_is_computed_leaves_the_engine_idle(make_engine):
    engine = make_engine(num_kv_blocks=64)
    engine.add_request("blocker", random_prompts(1, 200, 200, seed=9)[0], greedy(4))
    engine.add_request("multi", random_prompts(1, 50, 50, seed=10)[0], greedy(4, n=3))
    _, deltas = engine.abort(["multi"])
    assert sorted(d.index for d in deltas) == [0, 1, 2] and all(d.finish_reason == "abort" for d in deltas)
    run_to_completion(engine)
    assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == 64
