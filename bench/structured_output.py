"""Structured output (issue 21): the token mask's cost per decode step at 1 and 32 constrained requests, against
the step time, and the grammar compile times, measured in one run.

    .venv/bin/python bench/structured_output.py                 # 1 and 32 running, 16 timed decode steps each
    .venv/bin/python bench/structured_output.py --running 1 8 32 --steps 24 --threads 2

Builds the engine in-process on the embedded model (CPU, fp32, torch attention). For each N in `--running`:
N requests (random 64-token prompts, sampled at temperature 0.8) constrained by a JSON schema that cannot finish
within the timed steps (an array of at least 12 small objects: structural states with few allowed tokens and
string states with almost all allowed), prefilled, then `--steps` decode steps timed. The same N requests
unconstrained (`ignore_eos`) are the baseline, in the same run. Parts timed by wrapping:
- mask: `sampler.apply_grammars` (the matchers' bitmasks from the library, unpacked and applied to the logits);
- advance: `GrammarMatcher.accept` (the matcher consuming each sampled token, in the engine's token loop);
- step: `LLMEngine.step` as a whole.
Printed: ms per step for each, the mask's share of the constrained step, and the constrained step against the
baseline step. Compile times: the library's tokenizer (once per engine), then each test schema / regex / choice /
grammar compiled cold (no cache) and its first mask (the library builds its lexer lazily).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import time

import common

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "kind": {"enum": ["a", "b", "c"]}},
        "required": ["name", "qty", "kind"], "additionalProperties": False}
LONG_SCHEMA = {"type": "array", "items": ITEM, "minItems": 12}
COMPILE_CASES = {   # the tests' constraints (tests/e2e/test_structured_output.py)
    "json_schema nested": {"json_schema": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
    "json_schema array minItems": {"json_schema": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}},
    "json_schema enum+number": {"json_schema": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10}, "ok": {"type": "boolean"}},
        "required": ["colour", "score", "ok"], "additionalProperties": False}},
    "json_schema long array (bench)": {"json_schema": LONG_SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": r"[A-Z][a-z]{2,6}-[0-9]{2,4}"},
    "choice": {"choice": ["yes", "no", "it depends"]},
    "grammar": {"grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[1, 32], help="requests decoding together")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--json-out", help="also write the figures here")
    return p.parse_args(argv)


def timed(owner, name: str, label: str, totals: collections.Counter) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``totals[label]`` and its CPU time (all of
    this process's threads) to ``totals[label + "_cpu"]``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start, start_cpu = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
            totals[label + "_cpu"] += time.process_time() - start_cpu

    setattr(owner, name, wrapper)


def run(engine, num_running: int, steps: int, prompt_tokens: int, constrained: bool, totals) -> dict:
    """Add the requests, prefill them, time ``steps`` decode steps; ms per step of each part."""
    from pagedserve.sampling_params import SamplingParams

    rng = random.Random(num_running)
    extra = {"structured_output": {"json_schema": LONG_SCHEMA}} if constrained else {"ignore_eos": True}
    for i in range(num_running):
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
        engine.add_request(f"{'c' if constrained else 'u'}{num_running}-{i}", prompt,
                           SamplingParams(temperature=0.8, seed=i, max_tokens=steps + 8, **extra))
    engine.last_step_composition = {}
    while not (len(engine.last_step_composition) == num_running
               and all(v == 1 for v in engine.last_step_composition.values())):
        engine.step()                    # grammars compile, prompts prefill, until every request decodes
    totals.clear()
    step_times, step_cpu = [], 0.0
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        step_times.append(time.perf_counter() - start)
        step_cpu += time.process_time() - start_cpu
        assert len(engine.last_step_composition) == num_running, "a request finished inside the timed steps"
    engine.abort([f"{'c' if constrained else 'u'}{num_running}-{i}" for i in range(num_running)])
    return {"step_ms": 1e3 * statistics.mean(step_times), "step_ms_median": 1e3 * statistics.median(step_times),
            "step_cpu_ms": 1e3 * step_cpu / steps,
            "mask_ms": 1e3 * totals["mask"] / steps, "advance_ms": 1e3 * totals["advance"] / steps,
            "mask_cpu_ms": 1e3 * totals["mask_cpu"] / steps, "advance_cpu_ms": 1e3 * totals["advance_cpu"] / steps}


def compile_times(engine) -> dict:
    from pagedserve.structured_output import StructuredOutput
    from pagedserve.structured_output.grammar import fill_bitmasks

    out = {}
    start = time.perf_counter()
    engine.structured.compiler.tokenizer()
    out["tokenizer (once per engine)"] = {"compile_ms": 1e3 * (time.perf_counter() - start)}
    for name, value in COMPILE_CASES.items():
        constraint = StructuredOutput.from_value(value)
        start = time.perf_counter()
        compiled = engine.structured.compiler.compile(constraint)
        compile_ms = 1e3 * (time.perf_counter() - start)
        matcher = compiled.new_matcher()
        start = time.perf_counter()
        fill_bitmasks([matcher])
        out[name] = {"compile_ms": compile_ms, "first_mask_ms": 1e3 * (time.perf_counter() - start)}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = common.configure_threads(args.threads)
    from pagedserve.config import EngineConfig
    from pagedserve.sample import sampler as sampler_module
    from pagedserve.engine.builder import build_engine
    from pagedserve.structured_output.grammar import GrammarMatcher

    print(f"threads: {settings}   load average before: {os.getloadavg()}")
    engine, _ = build_engine(EngineConfig(device="cpu", dtype="float32", attention_backend="torch",
                                          max_num_seqs=max(args.running), num_kv_blocks=1024))
    totals: collections.Counter = collections.Counter()
    timed(sampler_module, "apply_grammars", "mask", totals)
    timed(GrammarMatcher, "accept", "advance", totals)
    compiles = compile_times(engine)
    print("\ncompile times (cold, no cache):")
    for name, t in compiles.items():
        first = f"   first mask {t['first_mask_ms']:.2f} ms" if "first_mask_ms" in t else ""
        print(f"  {name:<34} {t['compile_ms']:8.2f} ms{first}")
    results = {}
    print(f"\ndecode steps ({args.steps} timed per row), ms per step; wall (mean) and CPU (all threads):")
    print(f"  {'running':>7} {'clock':>5} {'base step':>10} {'cons step':>10} {'mask':>8} {'advance':>8} "
          f"{'mask/step':>10} {'(mask+adv)/step':>16} {'cons/base':>10}")
    for n in args.running:
        base = run(engine, n, args.steps, args.prompt_tokens, False, totals)
        cons = run(engine, n, args.steps, args.prompt_tokens, True, totals)
        results[n] = {"baseline": base, "constrained": cons}
        for clock, sfx in (("wall", ""), ("cpu", "_cpu")):
            step, base_step = cons[f"step{sfx}_ms"], base[f"step{sfx}_ms"]
            mask, adv = cons[f"mask{sfx}_ms"], cons[f"advance{sfx}_ms"]
            print(f"  {n:>7} {clock:>5} {base_step:>10.1f} {step:>10.1f} {mask:>8.2f} {adv:>8.2f} "
                  f"{100 * mask / step:>9.1f}% {100 * (mask + adv) / step:>15.1f}% {step / base_step:>10.3f}")
    print(f"load average after: {os.getloadavg()}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": settings, "compile": compiles, "steps": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
