"""Sampler cost: pagedserve's batched sampler against HF transformers' sampling path, same logits, one process.

    .venv/bin/python bench/sampler.py [--rows 1 16 32] [--repeats 20]

For each batch size and setting (temperature only; top-k 50 + top-p 0.95; top-p 0.95 alone; all at temperature
0.8), times one sampling step over float32 logits ``[rows, vocab]``:
- `ours`: ``pagedserve.sample.sampler.Sampler`` (raw logprobs off, no penalties): temperature, top-k / top-p found
  among the most likely candidates, inverse transform sampling with one float64 uniform per row.
- `hf`: transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` (the warpers
  ``generate`` applies, full-vocabulary sort for top-p), then ``softmax`` and ``torch.multinomial``, as in
  ``GenerationMixin._sample``.
Two kinds of logits: `model` (the embedded SmolLM2's own next-token logits, HF transformers float32, at the
positions of chat answers to the quick workload's prompts, teacher-forced) and `flat` (standard normal times 3: a
nucleus of thousands of tokens at top-p 0.95, the worst case for a candidate search).
Prints ms per step (median of --repeats) and ours / hf time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    settings = common.configure_threads(args.threads or common.os.cpu_count())

    import torch
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from pagedserve.sample.sampler import Sampler, SamplingRow
    from pagedserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    model, tokenizer = common.load_hf_model(), common.load_tokenizer()
    rows_needed = max(args.rows)
    model_rows = []
    with torch.no_grad():
        for prompt in common.QUICK_PROMPTS:
            ids = torch.tensor([common.chat_prompt_ids(tokenizer, prompt)])
            out = model.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=common.pad_id_of(tokenizer))
            model_rows.extend(step[0].float() for step in out.logits)
            if len(model_rows) >= rows_needed:
                break
    model_logits = torch.stack(model_rows)
    kinds = {"model": lambda n: model_logits[:n].contiguous(),
             "flat": lambda n: torch.randn(n, model_logits.shape[1], generator=gen) * 3.0}
    cases = {"temperature 0.8": dict(temperature=0.8),
             "top-k 50 + top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
             "top-p 0.95": dict(temperature=0.8, top_p=0.95)}
    sampler = Sampler(seed=0)
    print(", ".join(f"{k}={v}" for k, v in settings.items()) +
          f"; vocab {model_logits.shape[1]}, median of {args.repeats}")
    print(f"{'logits':<11} {'rows':>4}  {'setting':<22} {'ours ms':>8} {'hf ms':>8} {'ours/hf':>8}")
    for kind, make in kinds.items():
        for n in args.rows:
            logits = make(n)
            for name, kw in cases.items():
                params = SamplingParams(max_tokens=16, **kw)
                rows = [SamplingRow(params, [1, 2, 3], [4, 5]) for _ in range(n)]
                warpers = [TemperatureLogitsWarper(params.temperature)]
                if params.top_k:
                    warpers.append(TopKLogitsWarper(params.top_k))
                if params.top_p < 1.0:
                    warpers.append(TopPLogitsWarper(params.top_p))
                ids = torch.zeros(n, 1, dtype=torch.long)

                def hf():
                    scores = logits.clone()
                    for w in warpers:
                        scores = w(ids, scores)
                    return torch.multinomial(scores.softmax(dim=-1), num_samples=1)

                ours = _timed(lambda: sampler(logits, rows), args.repeats)
                base = _timed(hf, args.repeats)
                print(f"{kind:<11} {n:>4}  {name:<22} {ours * 1e3:8.2f} {base * 1e3:8.2f} {ours / base:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
