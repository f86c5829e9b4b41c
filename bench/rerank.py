"""Rerank throughput: pagedserve's gRPC Rerank (cross-encoder behind the cross-call batcher) against
sentence-transformers' `CrossEncoder.predict` on the same pairs, in the same run, at 1 and 16 concurrent calls of
32 pairs each.

    .venv/bin/python bench/rerank.py                          # MiniLM-L6 shape, 64 calls per level
    .venv/bin/python bench/rerank.py --num-calls 32 --concurrency 1 4 16 --threads 2

Model: a seeded random `BertForSequenceClassification` of cross-encoder/ms-marco-MiniLM-L6-v2's shape (6 layers,
hidden 384, 12 heads, one label; MiniLM's WordPiece tokenizer, max_length 512), saved with `save_pretrained`
(tests/cross_encoder_cases.py), so no download: speed depends on the shape, not the weights.

Workload: `--num-calls` calls, each one query (4..12 words) and `--pairs-per-call` (32) documents of 4 to
`--max-words` (80) words from bench/embed.py's word list, random.Random(`--seed`); every system scores the same
calls.

Systems, one after the other (never at the same time; interleaved, `--repeats` (3) times, each row keeping its
fastest run, so load from elsewhere hits them alike), same torch intra-op thread count (`--threads`):
  ours          `pagedserve serve --no-generation-model --embedding-model none --rerank-model DIR` subprocess;
                one asyncio gRPC channel, `concurrency` Rerank calls in flight. Wall time: first call issued to
                last response received.
  st            `CrossEncoder.predict(pairs_of_one_call, batch_size=32)` in this process: at concurrency 1 the
                calls one after another; at concurrency c, c threads each calling predict (a thread-pool server
                around CrossEncoder).
  st-seq        (concurrency > 1) the same calls one after another: what one predict worker does with a queue.
Throughput is pairs/s, and pairs per CPU-second of the process doing the work (the server's; this one's for st).
The scores of ours and st are compared (largest absolute difference). Prints a table and `ratio pairs/s
ours/st` per concurrency (and ours / the better of st and st-seq).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import sys
import tempfile
import time

import common
from embed import make_texts, process_cpu_s

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))   # cross_encoder_cases: the tests' checkpoint writer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-calls", type=int, default=64, help="Rerank calls per concurrency level")
    p.add_argument("--pairs-per-call", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-words", type=int, default=80, help="longest document, in words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads for both systems")
    p.add_argument("--server-arg", action="append", default=[], help="extra `pagedserve serve` flag (repeatable)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each (system, concurrency); the fastest is kept")
    p.add_argument("--skip-st", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def make_calls(args) -> list[tuple[str, list[str]]]:
    """``num_calls`` (query, documents) calls, deterministic in ``seed``."""
    rng = random.Random(args.seed)
    docs = make_texts(args.num_calls * args.pairs_per_call, args.max_words, args.seed)
    queries = [q.rstrip(".") + "?" for q in make_texts(args.num_calls, 12, args.seed + 1)]
    rng.shuffle(docs)
    n = args.pairs_per_call
    return [(queries[i], docs[i * n:(i + 1) * n]) for i in range(args.num_calls)]


def write_model(path: str, seed: int) -> str:
    import cross_encoder_cases as cases

    return cases.write_bert_cross_encoder(path, seed=seed, max_length=512, **cases.MINILM_L6)


async def _ours_level(target: str, calls, concurrency: int) -> tuple[list[list[float]], float]:
    from pagedserve_client import AsyncPagedServeClient

    limiter = asyncio.Semaphore(concurrency)
    async with AsyncPagedServeClient(target, timeout_s=600) as client:
        await client.rerank("warm", ["up"])              # channel connected before the clock starts

        async def one(query, docs):
            async with limiter:
                resp = await client.rerank(query, docs)
            scores = [0.0] * len(docs)
            for r in resp.results:
                scores[r.index] = r.score
            return scores

        start = time.perf_counter()
        scores = await asyncio.gather(*(one(q, d) for q, d in calls))
        return list(scores), time.perf_counter() - start


def st_predictor(model_dir: str):
    """``predict(call) -> scores``: CrossEncoder.predict on one call's pairs, batch_size 32 (its default)."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(model_dir, device="cpu")

    def predict(call) -> list[float]:
        query, docs = call
        return model.predict([(query, d) for d in docs], batch_size=32, show_progress_bar=False).tolist()
    return predict


def run_st(predict, calls, workers: int) -> tuple[list[list[float]], float, float]:
    """(scores, wall s, this process's CPU s) of every call, by ``workers`` threads (1: one after another)."""
    cpu0, start = process_cpu_s(os.getpid()), time.perf_counter()
    if workers == 1:
        scores = [predict(call) for call in calls]
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            scores = list(pool.map(predict, calls))
    return scores, time.perf_counter() - start, process_cpu_s(os.getpid()) - cpu0


def run_all(args, model_dir: str, calls) -> list[dict]:
    """Every (system, concurrency) ``--repeats`` times, interleaved (ours, st, st-seq per level, then again), so
    a burst of load from elsewhere hits every system alike; each row keeps its fastest repeat."""
    server = common.ServerProcess(args.threads, ["--no-generation-model", "--rerank-model", model_dir,
                                                 *args.server_arg])
    best: dict[tuple[str, int], dict] = {}

    def keep(name: str, c: int, scores, wall_s: float, cpu_s: float) -> None:
        row = best.get((name, c))
        if row is None or wall_s < row["wall_s"]:
            best[(name, c)] = {"system": name, "concurrency": c, "wall_s": wall_s, "cpu_s": cpu_s, "scores": scores}

    with server:
        asyncio.run(_ours_level(server.target, calls[:4], 4))          # warm-up
        predict = None if args.skip_st else st_predictor(model_dir)
        if predict is not None:
            run_st(predict, calls[:4], 1)                              # warm-up
        for _ in range(args.repeats):
            for c in args.concurrency:
                cpu0 = process_cpu_s(server.proc.pid)
                scores, wall_s = asyncio.run(_ours_level(server.target, calls, c))
                keep("ours", c, scores, wall_s, process_cpu_s(server.proc.pid) - cpu0)
                if predict is None:
                    continue
                keep("st", c, *run_st(predict, calls, c))
                if c > 1:
                    keep("st-seq", c, *run_st(predict, calls, 1))
    return [best[k] for k in sorted(best, key=lambda k: (k[1], k[0] != "ours", k[0]))]


def report(args, rows: list[dict]) -> dict:
    import numpy as np

    pairs = args.num_calls * args.pairs_per_call
    print(f"{'system':<8}{'concurrency':>12}{'pairs':>8}{'wall s':>9}{'pairs/s':>10}{'cpu s':>8}{'pairs/cpu-s':>13}")
    for r in rows:
        r["pairs_per_s"], r["pairs_per_cpu_s"] = pairs / r["wall_s"], pairs / max(r["cpu_s"], 1e-9)
        print(f"{r['system']:<8}{r['concurrency']:>12}{pairs:>8}{r['wall_s']:>9.2f}{r['pairs_per_s']:>10.1f}"
              f"{r['cpu_s']:>8.2f}{r['pairs_per_cpu_s']:>13.1f}")
    summary = {}
    for c in args.concurrency:
        by = {r["system"]: r for r in rows if r["concurrency"] == c}
        if "st" not in by:
            continue
        diff = float(np.abs(np.array(by["ours"]["scores"]) - np.array(by["st"]["scores"])).max())
        best_st = max(by[s]["pairs_per_s"] for s in ("st", "st-seq") if s in by)
        summary[c] = {"ratio_pairs_per_s": by["ours"]["pairs_per_s"] / by["st"]["pairs_per_s"],
                      "ratio_vs_best_st": by["ours"]["pairs_per_s"] / best_st,
                      "ratio_pairs_per_cpu_s": by["ours"]["pairs_per_cpu_s"] / by["st"]["pairs_per_cpu_s"],
                      "max_abs_score_diff": diff}
        print(f"concurrency {c}: ratio pairs/s ours/st {summary[c]['ratio_pairs_per_s']:.2f}   ours/best st "
              f"{summary[c]['ratio_vs_best_st']:.2f}   pairs per CPU-second ours/st "
              f"{summary[c]['ratio_pairs_per_cpu_s']:.2f}   max |score ours - st| {diff:.2e}")
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = common.configure_threads(args.threads)
    calls = make_calls(args)
    print(f"workload: {args.num_calls} calls x {args.pairs_per_call} pairs, documents 4..{args.max_words} words "
          f"(seed {args.seed}); concurrency {args.concurrency}; server args {args.server_arg}")
    print("threads:", threads)
    with tempfile.TemporaryDirectory(prefix="pagedserve-rerank-bench-") as model_dir:
        write_model(model_dir, args.seed)
        rows = run_all(args, model_dir, calls)
    summary = report(args, rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "threads": threads, "summary": summary,
                       "rows": [{k: v for k, v in r.items() if k != "scores"} for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
