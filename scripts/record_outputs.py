#!/usr/bin/env python
"""Record the engine's outputs over a fixed set of cases, and compare two recordings (a refactoring must not
change them).

    python scripts/record_outputs.py record OUT.json [--only CASE[,CASE...]]
    python scripts/record_outputs.py compare A.json B.json [--ignore-steps]

``record`` builds a few engines from :class:`EngineConfig` (the embedded SmolLM2 with the default CPU kernels; one
engine with torch attention and torch linears; one with ngram speculative decoding; one with a small prefill
budget and a small KV cache for chunked prefill and preemption) and runs each case's requests concurrently in one
engine (every request of a run added before the first ``step()``, so batching matters), some also alone. For every
delta it records the step it came in, token ids, text, finish_reason, matched_stop, logprobs and prompt logprobs
(rounded to 4 decimals), cumulative_logprob and usage without timings. Tool calls go through the OpenAI chat route
in process (the ASGI app over httpx.ASGITransport), one request at a time, greedy, ids and timestamps removed.
Everything is greedy or seeded: two recordings of the same code are equal.

``compare`` prints every difference (the top-level "meta" section, timings and paths, is ignored) and exits 1 when
there is one. ``--ignore-steps`` drops each delta's step number first (then only what came out, and in which
order per completion, is compared).

Uses only the engine's public surface: EngineConfig, build_engine, add_request / step / has_unfinished / abort /
stats / tokenizer / close, SamplingParams, CompletionDelta. (``build_engine`` is given the tokenizer and HF config
loaded once, through its own keyword arguments, so that the GGUF metadata is parsed once rather than per engine;
the model itself is loaded from the config each time.)

Set HF_HUB_OFFLINE=1. Takes a few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from support import CHAT_PROMPTS, TOOLS  # noqa: E402  (the tests' prompts and tools)

ROUND = 4
MAX_STEPS = 2000   # per run: a run that does not finish is an error, not a hang

# ---- engines -----------------------------------------------------------------------------------------------------
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
ENGINES = {
    # the default configuration (embedded SmolLM2, auto dtype/attention/kernels), with a smaller KV cache than the
    # default 2 GiB (block count does not change numerics; 512 blocks of 16 hold the model's 8192 context)
    "default": dict(num_kv_blocks=512),
    "torch": dict(num_kv_blocks=256, attention_backend="torch", linear_kernels="torch"),
    "spec": dict(num_kv_blocks=256, speculative_config=SPEC),
    # a 64-token step budget (chunked prefill) and 48 blocks of 16 (preemption with ~10 concurrent requests)
    "small": dict(num_kv_blocks=48, max_num_batched_tokens=64),
}

# ---- prompts -----------------------------------------------------------------------------------------------------
CHAT = CHAT_PROMPTS + ["Say hi.", "Name a color."]
COPY = [  # text the ngram drafter can copy from
    "Repeat exactly, word for word: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over "
    "the lazy dog.",
    "Copy this list: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "Write the numbers from 1 to 20 separated by commas.",
    "Repeat the sentence 'I like green tea' three times.",
]
LONG_PREFIX = ("You are a careful assistant for a library. The library opens at nine in the morning and closes at "
               "six in the evening on weekdays; on Saturdays it opens at ten and closes at four, and it is closed on "
               "Sundays and public holidays. Members may borrow up to eight books at a time for three weeks, and "
               "renew each loan twice unless another member has reserved the book. Late returns cost twenty cents a "
               "day per book, capped at five dollars. The reading room on the second floor is silent; group study "
               "rooms on the third floor can be booked for two hours at a time. Printing costs ten cents a page in "
               "black and white and fifty cents in colour. Answer questions about these rules briefly. ")
PREFIX_QUESTIONS = ["When does the library open on Saturday?", "How many books can I borrow?",
                    "How much does colour printing cost?"]
STRUCTURED = {
    "json_schema": {"json_schema": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}},
    "json_object": {"json_object": True},
    "regex": {"regex": r"[A-Z][a-z]{2,6}-[0-9]{2,4}"},
    "choice": {"choice": ["yes", "no", "it depends"]},
    "grammar": {"grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'},
}

# ---- tool calls (the OpenAI chat route) --------------------------------------------------------------------------
NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
TIME_Q = [{"role": "user", "content": "What time is it in Berlin?"}]
TOOL_REQUESTS = [
    ("named", dict(messages=WEATHER_Q, tools=TOOLS, tool_choice=NAMED, max_tokens=48)),
    ("named_stream", dict(messages=WEATHER_Q, tools=TOOLS, tool_choice=NAMED, max_tokens=48, stream=True)),
    ("required_single", dict(messages=TIME_Q, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                             max_tokens=64)),
    ("required_parallel", dict(messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=96)),
    ("auto_hermes", dict(messages=WEATHER_Q, tools=TOOLS, tool_choice="auto", max_tokens=48)),
    ("none", dict(messages=WEATHER_Q, tools=TOOLS, tool_choice="none", max_tokens=24)),
    ("named_logprobs", dict(messages=TIME_Q, tools=TOOLS, tool_choice={"type": "function",
                                                                        "function": {"name": "get_time"}},
                            max_tokens=32, logprobs=True, top_logprobs=2)),
]


# ---- recording ---------------------------------------------------------------------------------------------------
def r4(x):
    return None if x is None else round(float(x), ROUND)


def lp_list(lps):
    if lps is None:
        return None
    return [[t.token_id, r4(t.logprob), t.rank, [[i, r4(v)] for i, v in t.top]] for t in lps]


def delta_dict(d, step: int) -> dict:
    u = d.usage
    out = {"step": step, "token_ids": list(d.token_ids), "text": d.text, "finish_reason": d.finish_reason,
           "matched_stop": d.matched_stop, "logprobs": lp_list(d.logprobs),
           "prompt_logprobs": lp_list(d.prompt_logprobs), "cumulative_logprob": r4(d.cumulative_logprob),
           "usage": None if u is None else {"prompt_tokens": u.prompt_tokens,
                                            "completion_tokens": u.completion_tokens,
                                            "cached_prompt_tokens": u.cached_prompt_tokens},
           "error": None if d.error is None else f"{type(d.error).__name__}: {d.error}"}
    return out


STAT_KEYS = ("num_preemptions", "prefix_cache_queries_tokens", "prefix_cache_hits_tokens",
             "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class Recorder:
    def __init__(self, engine, tokenizer):
        self.engine, self.tok = engine, tokenizer

    def chat(self, text: str, system: str | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        out = self.tok.apply_chat_template(msgs, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def run(self, requests, aborts: dict[int, list[str]] | None = None) -> dict:
        """Add every (rid, prompt ids, params) of ``requests``, step until idle (aborting ``aborts[step]`` after that
        step); returns {"requests": {rid: {"prompt_len", "completions": {index: [delta, ...]}}}, "steps", "stats"}."""
        e = self.engine
        before = e.stats()
        out = {}
        for rid, ids, params in requests:
            e.add_request(rid, ids, params)
            out[rid] = {"prompt_len": len(ids), "completions": {}}
        step = 0

        def note(deltas):
            for d in deltas:
                out[d.request_id]["completions"].setdefault(str(d.index), []).append(delta_dict(d, step))

        while e.has_unfinished():
            step += 1
            if step > MAX_STEPS:
                raise RuntimeError(f"run did not finish in {MAX_STEPS} steps")
            note(e.step())
            if aborts and step in aborts:
                aborted, deltas = e.abort(aborts[step])
                note(deltas)
                out.setdefault("_aborted", []).append({"step": step, "ids": aborted})
        after = e.stats()
        stats = {k: after.get(k, 0) - before.get(k, 0) for k in STAT_KEYS}
        stats["all_blocks_free"] = after["num_blocks_free"] == after["num_blocks_total"]
        return {"requests": out, "steps": step, "stats": stats}

    def drain(self, requests) -> None:
        """Run requests without recording (warming the grammar cache so later runs never wait on a compile)."""
        for rid, ids, params in requests:
            self.engine.add_request(rid, ids, params)
        for _ in range(MAX_STEPS):
            if not self.engine.has_unfinished():
                return
            self.engine.step()
        raise RuntimeError("warm-up did not finish")


# ---- the cases (each returns a list of runs) ---------------------------------------------------------------------
def P(**kw):
    from pagedserve.sampling_params import SamplingParams
    return SamplingParams(**kw)


def G(max_tokens=20, **kw):
    return P(max_tokens=max_tokens, temperature=0.0, **kw)


SAMPLED = dict(temperature=0.9, top_p=0.9, top_k=40, min_p=0.05)


def case_greedy(r: Recorder):
    reqs = [(f"g{i}", r.chat(CHAT[i]), G(24)) for i in range(4)] + [("g_eos", r.chat(CHAT[8]), G(32))]
    return [r.run(reqs), r.run([("g0_alone", r.chat(CHAT[0]), G(24))])]


def case_seeded(r: Recorder):
    reqs = [(f"s{i}", r.chat(CHAT[i + 2]), P(max_tokens=20, seed=100 + i, **SAMPLED)) for i in range(4)]
    reqs += [("s_other_seed", r.chat(CHAT[2]), P(max_tokens=20, seed=7, **SAMPLED)),
             ("s_topk", r.chat(CHAT[3]), P(max_tokens=16, temperature=1.0, top_k=5, seed=11)),
             ("s_topp", r.chat(CHAT[4]), P(max_tokens=16, temperature=1.0, top_p=0.5, seed=12)),
             ("s_minp", r.chat(CHAT[5]), P(max_tokens=16, temperature=1.3, min_p=0.1, seed=13)),
             ("s_greedy_mixed", r.chat(CHAT[6]), G(16))]
    alone = [("s0_alone", r.chat(CHAT[2]), P(max_tokens=20, seed=100, **SAMPLED))]
    return [r.run(reqs), r.run(alone)]


def case_n3(r: Recorder):
    reqs = [("n_a", r.chat(CHAT[0]), P(max_tokens=16, n=3, seed=42, **SAMPLED)),
            ("n_b", r.chat(CHAT[6]), P(max_tokens=16, n=3, seed=43, temperature=1.0)),
            ("n_greedy", r.chat(CHAT[7]), G(16, n=2))]
    return [r.run(reqs), r.run([("n_a_alone", r.chat(CHAT[0]), P(max_tokens=16, n=3, seed=42, **SAMPLED))])]


def beam(k, n=1, lp=1.0, early=False, **kw):
    return P(temperature=0.0, n=n, beam_search={"beam_width": k, "length_penalty": lp, "early_stopping": early}, **kw)


def case_beam(r: Recorder):
    reqs = [("b_k3n2", r.chat(CHAT[1]), beam(3, 2, max_tokens=16)),
            ("b_k2_early", r.chat(CHAT[8]), beam(2, 1, 0.5, True, max_tokens=12)),
            ("b_with_greedy", r.chat(CHAT[9]), G(12))]
    return [r.run(reqs), r.run([("b_k4n3_alone", r.chat(CHAT[0]), beam(4, 3, 2.0, True, max_tokens=10))])]


def case_logprobs(r: Recorder):
    reqs = [("lp5", r.chat(CHAT[1]), G(12, logprobs=5)),
            ("lp0", r.chat(CHAT[2]), G(12, logprobs=0)),
            ("lp_prompt3", r.chat(CHAT[3]), P(max_tokens=12, seed=5, logprobs=2, prompt_logprobs=3, **SAMPLED)),
            ("lp_prompt0", r.chat(CHAT[9]), G(8, prompt_logprobs=0)),
            ("lp_none", r.chat(CHAT[4]), G(8))]
    return [r.run(reqs), r.run([("lp5_alone", r.chat(CHAT[1]), G(12, logprobs=5, prompt_logprobs=2))])]


def case_penalties(r: Recorder):
    tok = r.tok
    the, paris = tok.encode(" the", add_special_tokens=False)[0], tok.encode(" Paris", add_special_tokens=False)[0]
    reqs = [("pen_rep", r.chat(CHAT[3]), G(24, repetition_penalty=1.3)),
            ("pen_pres_freq", r.chat(CHAT[3]), G(24, presence_penalty=0.8, frequency_penalty=0.6)),
            ("pen_neg", r.chat(CHAT[5]), G(24, presence_penalty=-0.5, frequency_penalty=-0.3)),
            ("pen_bias", r.chat(CHAT[1]), G(16, logit_bias={paris: -100.0, the: 3.0})),
            ("pen_min_tokens", r.chat(CHAT[8]), G(16, min_tokens=12)),
            ("pen_sampled", r.chat(CHAT[6]), P(max_tokens=20, seed=9, repetition_penalty=1.2, presence_penalty=0.5,
                                               frequency_penalty=0.5, logit_bias={the: -5.0}, min_tokens=5,
                                               **SAMPLED))]
    return [r.run(reqs), r.run([("pen_rep_alone", r.chat(CHAT[3]), G(24, repetition_penalty=1.3))])]


def case_stops(r: Recorder):
    tok = r.tok
    period = tok.encode(".", add_special_tokens=False)[0]
    comma = tok.encode(",", add_special_tokens=False)[0]
    reqs = [("st_period", r.chat(CHAT[3]), G(40, stop=["."])),
            ("st_incl", r.chat(CHAT[3]), G(40, stop=[" is", "zzz"], include_stop_str_in_output=True)),
            ("st_multi", r.chat(CHAT[1]), G(40, stop=["France", "\n"])),
            ("st_ids", r.chat(CHAT[4]), G(40, stop_token_ids=[period, comma])),
            ("st_ignore_eos", r.chat(CHAT[8]), G(24, ignore_eos=True, stop_token_ids=[comma])),
            ("st_sampled", r.chat(CHAT[6]), P(max_tokens=40, seed=21, stop=["\n", "."], **SAMPLED)),
            ("st_special", r.chat(CHAT[9]), G(16, skip_special_tokens=False, ignore_eos=True))]
    return [r.run(reqs)]


def case_structured(r: Recorder):
    warm = [(f"warm_{k}", r.chat("Hi."), G(1, structured_output=v)) for k, v in STRUCTURED.items()]
    r.drain(warm)
    prompts = {"json_schema": "Describe a person as JSON with name and age.",
               "json_object": "Give me a JSON object describing a cat.",
               "regex": "Invent a product code.", "choice": "Is the sky blue?",
               "grammar": "What is 6 times 7?"}
    reqs = [(f"so_{k}", r.chat(prompts[k]), G(40, structured_output=STRUCTURED[k])) for k in STRUCTURED]
    reqs += [("so_schema_sampled", r.chat(prompts["json_schema"]),
              P(max_tokens=48, seed=3, temperature=1.0, structured_output=STRUCTURED["json_schema"])),
             ("so_regex_n2", r.chat(prompts["regex"]),
              P(max_tokens=16, n=2, seed=4, temperature=1.0, structured_output=STRUCTURED["regex"])),
             ("so_unconstrained", r.chat(CHAT[9]), G(12))]
    alone = [("so_choice_alone", r.chat("Is water wet?"), G(8, structured_output=STRUCTURED["choice"], logprobs=3))]
    return [r.run(reqs), r.run(alone)]


def case_prefix(r: Recorder):
    ids = [r.chat(q, system=LONG_PREFIX) for q in PREFIX_QUESTIONS]
    return [r.run([("px_first", ids[0], G(12))]),
            r.run([("px_second", ids[1], G(12)), ("px_third", ids[2], P(max_tokens=12, seed=8, **SAMPLED)),
                   ("px_repeat", ids[0], G(12))])]


def case_abort(r: Recorder):
    reqs = [("ab_keep", r.chat(CHAT[0]), G(20)),
            ("ab_greedy", r.chat(CHAT[3]), G(20)),
            ("ab_n2", r.chat(CHAT[5]), P(max_tokens=20, n=2, seed=6, **SAMPLED)),
            ("ab_beam", r.chat(CHAT[7]), beam(2, 1, max_tokens=20)),
            ("ab_unknown_is_ignored", r.chat(CHAT[9]), G(12))]
    return [r.run(reqs, aborts={4: ["ab_beam"], 6: ["ab_greedy", "ab_n2", "no_such_request"]})]


def case_torch(r: Recorder):
    reqs = [(f"t{i}", r.chat(CHAT[i]), G(16)) for i in range(3)]
    reqs += [("t_seeded", r.chat(CHAT[4]), P(max_tokens=16, seed=31, **SAMPLED)),
             ("t_lp", r.chat(CHAT[5]), G(8, logprobs=3, prompt_logprobs=1))]
    return [r.run(reqs), r.run([("t0_alone", r.chat(CHAT[0]), G(16))])]


def case_spec(r: Recorder):
    reqs = [(f"sp{i}", r.chat(COPY[i]), G(32)) for i in range(3)]
    reqs += [("sp_seeded", r.chat(COPY[3]), P(max_tokens=32, seed=17, temperature=0.8)),
             ("sp_seeded_n2", r.chat(COPY[1]), P(max_tokens=24, n=2, seed=18, **SAMPLED))]
    alone = [("sp_alone", r.chat(COPY[0]), G(40, logprobs=2)),
             ("sp_stop", r.chat(COPY[2]), G(48, stop=["15"]))]
    return [r.run(reqs), r.run(alone[:1]), r.run(alone[1:])]


def long_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def case_chunked(r: Recorder):
    text = r.chat("Summarize the rules below in one sentence.", system=LONG_PREFIX + LONG_PREFIX[:300])
    reqs = [("ch_long_chat", text, G(16)),
            ("ch_long_random", long_ids(240, 1), G(12, ignore_eos=True)),
            ("ch_short0", r.chat(CHAT[0]), G(16)),
            ("ch_short1", r.chat(CHAT[8]), P(max_tokens=16, seed=2, **SAMPLED))]
    return [r.run(reqs), r.run([("ch_long_alone", long_ids(200, 2), G(8, ignore_eos=True))])]


def case_preemption(r: Recorder):
    reqs = []
    for i in range(10):
        ids = long_ids(60 + 3 * i, 100 + i)
        params = G(40, ignore_eos=True) if i % 3 else P(max_tokens=40, seed=50 + i, ignore_eos=True, **SAMPLED)
        reqs.append((f"pr{i}", ids, params))
    run = r.run(reqs)
    if run["stats"]["num_preemptions"] <= 0:
        print("WARNING: preemption case saw no preemption", file=sys.stderr)
    return [run]


CASES = [  # (name, engine, function)
    ("greedy", "default", case_greedy),
    ("seeded_sampling", "default", case_seeded),
    ("n3_seeded", "default", case_n3),
    ("beam_search", "default", case_beam),
    ("logprobs", "default", case_logprobs),
    ("penalties_bias_min_tokens", "default", case_penalties),
    ("stops", "default", case_stops),
    ("structured_output", "default", case_structured),
    ("prefix_caching", "default", case_prefix),
    ("abort", "default", case_abort),
    ("tool_calls_http", "default", None),        # last on "default": it hands the engine to the async front
    ("torch_kernels", "torch", case_torch),
    ("speculative_ngram", "spec", case_spec),
    ("chunked_prefill", "small", case_chunked),
    ("preemption", "small", case_preemption),
]


# ---- tool calls through the OpenAI chat route --------------------------------------------------------------------
def _scrub(obj):
    """Drop what differs run to run by design: response / tool-call ids, timestamps."""
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(obj, list):
        return [_scrub(v) for v in obj]
    if isinstance(obj, float):
        return r4(obj)
    return obj


async def _tool_calls(engine, info) -> dict:
    import httpx

    from pagedserve.config import EngineConfig, ServerConfig
    from pagedserve.http.app import build_app
    from pagedserve.serving.auth import ApiKeys
    from pagedserve.serving.factory import ServiceFactory
    from pagedserve.serving.metrics import ServerMetrics
    from pagedserve.serving.services import Services, served_names

    config = ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model="",
                          enable_auto_tool_choice=True, tool_call_parser="hermes")
    factory = ServiceFactory(config, EngineConfig(**ENGINES["default"]),
                             build_engine=lambda _cfg: (engine, info))
    services = Services(*served_names(config, None))
    metrics = ServerMetrics()
    await factory.load(services, metrics)
    services.loading = False
    _, gate = build_app(config, services, metrics, ApiKeys())
    out = {}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://in-process",
                                     timeout=600) as client:
            for name, body in TOOL_REQUESTS:   # one at a time: each runs alone in the engine
                body = {"model": services.generation_name, "temperature": 0.0, **body}
                resp = await client.post("/v1/chat/completions", json=body)
                if body.get("stream"):
                    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
                    out[name] = {"status": resp.status_code, "chunks": _scrub(chunks)}
                else:
                    out[name] = {"status": resp.status_code, "body": _scrub(resp.json())}
    finally:
        await services.aclose()
    return out


# ---- main --------------------------------------------------------------------------------------------------------
def record(path: str, only: set[str] | None) -> None:
    import torch

    import pagedserve
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    t_start = time.monotonic()
    src_dir = os.path.dirname(os.path.dirname(os.path.abspath(pagedserve.__file__)))
    try:
        head = subprocess.run(["git", "-C", src_dir, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src_dir, "status", "--porcelain", "--", "."], capture_output=True,
                               text=True).stdout.strip() != ""
    except OSError:
        head, dirty = None, None
    print(f"pagedserve from {pagedserve.__file__} (HEAD {head}{', dirty' if dirty else ''})", file=sys.stderr)

    try:  # parse the GGUF metadata once for every engine (build_engine's own keyword arguments)
        from pagedserve.models.loader import ModelSource
        src = ModelSource.resolve(None)
        shared = {"tokenizer": src.load_tokenizer(), "hf_config": src.load_config()}
    except Exception as exc:  # noqa: BLE001
        print(f"(loading the tokenizer once failed: {exc!r}; each engine loads its own)", file=sys.stderr)
        shared = {}

    result = {"meta": {"pagedserve_file": pagedserve.__file__, "git_head": head, "git_dirty": dirty,
                       "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "argv": sys.argv,
                       "case_seconds": {}, "engine_build_seconds": {}},
              "engines": {}, "cases": {}}
    cases = [c for c in CASES if only is None or c[0] in only]
    for engine_name in dict.fromkeys(c[1] for c in cases):
        t = time.monotonic()
        config = EngineConfig(**ENGINES[engine_name])
        engine, info = build_engine(config, **shared) if shared else build_engine(config)
        result["meta"]["engine_build_seconds"][engine_name] = round(time.monotonic() - t, 1)
        result["engines"][engine_name] = {
            "config": ENGINES[engine_name],
            "info": {k: getattr(info, k) for k in ("architecture", "dtype", "device", "attention_backend",
                                                   "max_model_len", "vocab_size", "block_size", "num_kv_blocks",
                                                   "quantization", "linear_kernels", "speculative",
                                                   "kv_cache_dtype", "prefill_attention_dtype", "compiled")}}
        rec = Recorder(engine, engine.tokenizer)
        handed_over = False
        for name, eng, fn in cases:
            if eng != engine_name:
                continue
            t = time.monotonic()
            if fn is None:
                result["cases"][name] = asyncio.run(_tool_calls(engine, info))
                handed_over = True
            else:
                result["cases"][name] = {"runs": fn(rec)}
            dt = time.monotonic() - t
            result["meta"]["case_seconds"][name] = round(dt, 1)
            print(f"  {engine_name}/{name}: {dt:.1f} s ({_count(result['cases'][name])} completions)",
                  file=sys.stderr)
        if not handed_over:
            engine.close()
        del engine, rec
    result["meta"]["total_seconds"] = round(time.monotonic() - t_start, 1)
    result["meta"]["completions"] = {name: _count(c) for name, c in result["cases"].items()}
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {path} in {result['meta']['total_seconds']} s", file=sys.stderr)


def _count(case: dict) -> int:
    if "runs" not in case:
        return sum(len(v.get("body", {}).get("choices", [])) or 1 for v in case.values())
    return sum(len(req["completions"]) for run in case["runs"] for rid, req in run["requests"].items()
               if not rid.startswith("_"))


def _strip_steps(obj):
    if isinstance(obj, dict):
        return {k: _strip_steps(v) for k, v in obj.items() if k not in ("step", "steps")}
    if isinstance(obj, list):
        return [_strip_steps(v) for v in obj]
    return obj


def _diff(a, b, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                out.append(f"{path}/{k}: only in B: {json.dumps(b[k])[:300]}")
            elif k not in b:
                out.append(f"{path}/{k}: only in A: {json.dumps(a[k])[:300]}")
            else:
                _diff(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: {json.dumps(a)[:300]} != {json.dumps(b)[:300]}")


def compare(path_a: str, path_b: str, ignore_steps: bool) -> int:
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    a.pop("meta", None)
    b.pop("meta", None)
    if ignore_steps:
        a, b = _strip_steps(a), _strip_steps(b)
    diffs: list[str] = []
    _diff(a, b, "", diffs)
    for line in diffs:
        print(line)
    cases = sorted(set(a.get("cases", {})) | set(b.get("cases", {})))
    bad = sorted({d.split("/")[2] for d in diffs if d.startswith("/cases/") and d.count("/") >= 2})
    print(f"{len(diffs)} difference(s); {len(cases)} cases, differing: {', '.join(bad) or 'none'}"
          + ("" if not diffs or bad else " (outside the cases)"))
    return 1 if diffs else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out")
    rec.add_argument("--only", help="comma-separated case names (default: all)")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--ignore-steps", action="store_true", help="ignore the step each delta came in")
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.out, set(args.only.split(",")) if args.only else None)
        return 0
    return compare(args.a, args.b, args.ignore_steps)


if __name__ == "__main__":
    sys.exit(main())
