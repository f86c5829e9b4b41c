"""Deterministic outputs whatever the batch (README, "Deterministic outputs"): on the embedded model served as built
(Q4_1 linears, Q8_0 LM head, the cpu attention backend), a greedy request and a seeded request at temperature 1 give
the same tokens, token for token,

- alone, and beside short requests, beside a long prompt in prefill, and beside both;
- with their prompts prefilled whole, or in chunks of 16, 64 and 512 tokens;
- with their prompts found in the prefix cache, or cold;
- preempted (recomputed) in the middle of their decode, or not;
- and the greedy one with ngram speculative decoding (4 drafts verified as prefill-like rows) or without;

for every own linear-kernel choice ("auto": two-level int8 activations, "int8-activations": one level,
"float-activations") and a float32 and a bfloat16 KV cache. The "torch" choice is not batch-invariant (its BLAS
blocks by shape) and the engine's info says so (test_info_says_which_kernels_run)."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.builder import build_engine
from pagedserve.kernels.cpu_build import cpu_kernel_ops
from pagedserve.models.cpu_linear import VNNI_MAX_TOKENS, use_int8_activations, use_vnni, vnni_available
from pagedserve.sampling_params import SamplingParams
from support import run_to_completion

pytestmark = pytest.mark.skipif(cpu_kernel_ops() is None, reason="CPU kernels unavailable")

NEW_TOKENS = 20
TARGETS = {"greedy": SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
           "seeded": SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=1234, ignore_eos=True)}


def _prompt(tokenizer, n: int, salt: int) -> list[int]:
    """``n`` prompt tokens of varied English (Python's bundled topic texts), shifted by ``salt``."""
    import pydoc_data.topics as t
    text = " ".join(t.topics[k] for k in sorted(t.topics)[salt:salt + 40])
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module", params=["auto", "int8-activations", "float-activations"])
def model_as(request, llm_int4):
    """The embedded int4 model with its layers set as the ``linear_kernels`` choice would build them."""
    m = llm_int4
    if m.linear_kernels != "pagedserve-cpu":
        pytest.skip("the own kernels did not build the model")
    levels, vnni = m.a8_levels, m.vnni_max_tokens
    if request.param == "float-activations":
        use_int8_activations(m, 0)
        use_vnni(m, 0)
    elif request.param == "int8-activations":
        use_int8_activations(m, 1, 1)
        use_vnni(m, VNNI_MAX_TOKENS if vnni_available() else 0)   # the fused decode stack takes the levels anew
    yield m
    use_int8_activations(m, 1, levels)
    use_vnni(m, vnni)


def _run(model, parts, scenario: str, kv: str) -> dict[str, list[int]]:
    """The two targets' tokens under ``scenario``."""
    _, tokenizer, cfg = parts
    target = _prompt(tokenizer, 200, 0)
    config = dict(device="cpu", num_kv_blocks=256, kv_cache_dtype=kv, enable_prefix_caching=True)
    if scenario.startswith("chunk"):
        config.update(max_num_batched_tokens=int(scenario[5:]), long_prefill_token_threshold=int(scenario[5:]))
    if scenario == "speculative":
        config.update(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}')
    if scenario == "preempted":
        config.update(num_kv_blocks=33)   # the long request's growth takes the targets' blocks mid-decode
    engine, _ = build_engine(EngineConfig(**config), model=model, tokenizer=tokenizer, hf_config=cfg)
    if scenario == "cached":   # the prompt's blocks in the prefix cache first
        engine.add_request("warm", target, SamplingParams(max_tokens=1))
        run_to_completion(engine)
    if scenario == "preempted":
        engine.add_request("long", _prompt(tokenizer, 260, 7), SamplingParams(max_tokens=90, ignore_eos=True))
        engine.step()
    for name, params in TARGETS.items():
        if scenario != "speculative" or name == "greedy":   # a seeded draw differs with drafts (same distribution)
            engine.add_request(name, target, params)
    others = []
    if scenario in ("short", "both"):
        others += [("short", _prompt(tokenizer, 5 + 3 * i, 20 + i), 12) for i in range(4)]
    if scenario in ("long", "both"):
        others += [("long", _prompt(tokenizer, 700, 40), 4)]

    def add_others(engine, deltas):   # once the targets decode, so the long prompt's prefill shares their steps
        while others and engine.scheduler.num_waiting == 0:
            name, ids, n = others.pop()
            engine.add_request(f"{name}{len(others)}", ids, SamplingParams(max_tokens=n, ignore_eos=True))

    out = run_to_completion(engine, on_step=add_others)
    stats = engine.stats()
    del engine
    gc.collect()   # its KV cache goes now, not at some later collection
    if scenario == "preempted":
        assert stats["num_preemptions"] > 0
    if scenario == "cached":
        assert stats["prefix_cache_hits_tokens"] >= 192   # the prompt's 12 full blocks, twice
    assert not others
    if scenario == "speculative":
        assert stats["spec_decode_num_draft_tokens"] > 0   # drafts verified as multi-row steps
    return {name: out[name][0][0] for name in TARGETS if name in out}


ALL = ("short", "long", "both", "chunk16", "chunk64", "chunk512", "cached", "preempted", "speculative")


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_same_tokens_whatever_the_batch(model_as, llm_parts, kv, request):
    """Every scenario for "auto" (the default); for the other choices, whose kernels are the same code with other
    settings, the batch (both), the smallest chunks, the prefix cache and a preemption."""
    alone = _run(model_as, llm_parts, "alone", kv)
    assert all(len(ids) == NEW_TOKENS for ids in alone.values())
    auto = request.node.callspec.params["model_as"] == "auto"
    for scenario in ALL if auto else ("both", "chunk16", "cached", "preempted"):
        got = _run(model_as, llm_parts, scenario, kv)
        for name in got:
            assert got[name] == alone[name], f"{name} request, {scenario}: {got[name]} vs alone {alone[name]}"


def test_info_says_which_kernels_run(llm_int4, llm_parts):
    """GetModelInfo's batch_invariant and kernels (EngineInfo): true on the own kernels with the cpu backend, false
    with the torch attention reference."""
    _, tokenizer, cfg = llm_parts
    engine, info = build_engine(EngineConfig(device="cpu", num_kv_blocks=8), model=llm_int4, tokenizer=tokenizer,
                                hf_config=cfg)
    del engine
    assert info.batch_invariant and info.kernels.startswith("linears: int8 activations x2 (int4: ")
    assert "attention: batch-invariant paged attention" in info.kernels
    engine, ref = build_engine(EngineConfig(device="cpu", num_kv_blocks=8, attention_backend="torch"),
                               model=llm_int4, tokenizer=tokenizer, hf_config=cfg)
    del engine
    assert not ref.batch_invariant and ref.kernels.endswith("attention: torch")
