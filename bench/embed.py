"""Embedding throughput: pagedserve's Embed over gRPC (8 concurrent clients) against sentence-transformers
`encode` on the same texts, with the embedded all-MiniLM-L6-v2.

    .venv/bin/python bench/embed.py                       # 1,000 texts, 8 clients, 8 texts per call
    .venv/bin/python bench/embed.py --call-size 1 --server-arg=--max-embed-batch-tokens=4096

Workload: `--num-texts` (1,000) English-like texts of 4 to `--max-words` (120) words drawn from a fixed word list
with random.Random(`--seed`), so lengths span a few to ~200 wordpiece tokens (the model's limit is 256).

Systems, measured one after the other (never at the same time), same torch intra-op thread count (`--threads`):
  ours  `pagedserve serve --no-generation-model` subprocess. `--clients` (8) asyncio clients, each on its own
        channel, take every `--clients`-th text and send them in Embed calls of `--call-size` texts, one call after
        another; all clients start together. Wall time: first call issued to last response received.
  st    `SentenceTransformer.encode(texts, batch_size=--st-batch-size)` (32, its default) in this process,
        after a warm-up encode.
Throughput is texts/s and input tokens/s (wordpiece tokens, special tokens included). The vectors of the two are
compared (minimum cosine). Prints a table and `ratio texts/s ours/st` (issue 9's goal: at least 1.0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import common

WORDS = ("the of and to in is was for on that with as by at from his her an which or had are but not this be were "
         "they one all their has have been more when who will there would can time first two other about new "
         "after into years only over most city world government people system river music history school war "
         "company language during between under series family united national number state group water since "
         "memory batching attention kernel request server latency throughput embedding vector cosine token block "
         "cache scheduler sequence prefill decode sampling streaming model weights quantized graph compiler").split()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-texts", type=int, default=1000)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, one channel each")
    p.add_argument("--call-size", type=int, default=8, help="texts per Embed call")
    p.add_argument("--st-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads for both systems")
    p.add_argument("--server-arg", action="append", default=[], help="extra `pagedserve serve` flag (repeatable)")
    p.add_argument("--skip-st", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def make_texts(num_texts: int, max_words: int, seed: int) -> list[str]:
    """Deterministic texts of 4..max_words words, the first letter capitalised, ending with a period."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, max_words))]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


async def _client(target: str, texts: list[str], call_size: int, start: asyncio.Event) -> list[tuple[int, list]]:
    from pagedserve_client import AsyncPagedServeClient

    out = []
    async with AsyncPagedServeClient(target, timeout_s=600) as client:
        await client.embed(["warm-up"])                # channel connected before the clock starts
        await start.wait()
        for i in range(0, len(texts), call_size):
            resp = await client.embed(texts[i:i + call_size])
            out.append((resp.usage.prompt_tokens, [list(e.values) for e in resp.embeddings]))
    return out


async def run_clients(target: str, texts: list[str], num_clients: int, call_size: int, server_pid: int):
    """Returns (vectors in text order, prompt tokens, wall seconds, server CPU seconds over that wall time)."""
    start = asyncio.Event()
    shares = [texts[c::num_clients] for c in range(num_clients)]
    tasks = [asyncio.ensure_future(_client(target, share, call_size, start)) for share in shares]
    await asyncio.sleep(1.0)                           # every client connected and warmed up
    cpu0, t0 = process_cpu_s(server_pid), time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks)
    wall_s, cpu_s = time.perf_counter() - t0, process_cpu_s(server_pid) - cpu0
    vectors: list = [None] * len(texts)
    tokens = 0
    for c, calls in enumerate(results):
        flat = [v for _, vs in calls for v in vs]
        tokens += sum(t for t, _ in calls)
        for j, v in enumerate(flat):
            vectors[c + j * num_clients] = v
    return vectors, tokens, wall_s, cpu_s


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_ours(args, texts) -> dict:
    server = common.ServerProcess(args.threads, ["--no-generation-model", *args.server_arg])
    i = server.argv.index("--embedding-model")
    del server.argv[i:i + 2]
    with server:
        vectors, tokens, wall_s, cpu_s = asyncio.run(run_clients(server.target, texts, args.clients,
                                                                 args.call_size, server.proc.pid))
    return {"system": "ours", "texts": len(texts), "tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s,
            "vectors": vectors}


def bench_st(args, texts) -> dict:
    from sentence_transformers import SentenceTransformer

    from pagedserve.models.loader import embedded_embedding_path

    model = SentenceTransformer(embedded_embedding_path(), device="cpu")
    model.encode(texts[:64], batch_size=args.st_batch_size)
    cpu0, t0 = process_cpu_s(os.getpid()), time.perf_counter()
    vectors = model.encode(texts, batch_size=args.st_batch_size, normalize_embeddings=True)
    wall_s, cpu_s = time.perf_counter() - t0, process_cpu_s(os.getpid()) - cpu0
    tokens = sum(len(ids) for ids in model.tokenizer(texts, truncation=True, max_length=256)["input_ids"])
    return {"system": "st", "texts": len(texts), "tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s,
            "vectors": vectors.tolist()}


def report(rows: list[dict]) -> dict:
    import numpy as np

    print(f"{'system':<8}{'texts':>8}{'tokens':>9}{'wall s':>9}{'texts/s':>10}{'tokens/s':>11}{'cpu s':>8}"
          f"{'texts/cpu-s':>13}")
    for r in rows:
        r["texts_per_s"], r["tokens_per_s"] = r["texts"] / r["wall_s"], r["tokens"] / r["wall_s"]
        r["texts_per_cpu_s"] = r["texts"] / r["cpu_s"]
        print(f"{r['system']:<8}{r['texts']:>8}{r['tokens']:>9}{r['wall_s']:>9.2f}{r['texts_per_s']:>10.1f}"
              f"{r['tokens_per_s']:>11.0f}{r['cpu_s']:>8.1f}{r['texts_per_cpu_s']:>13.1f}")
    summary = {}
    if len(rows) == 2:
        a, b = (np.array(r["vectors"], dtype=np.float64) for r in rows)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        summary = {"ratio_texts_per_s": rows[0]["texts_per_s"] / rows[1]["texts_per_s"],
                   "ratio_texts_per_cpu_s": rows[0]["texts_per_cpu_s"] / rows[1]["texts_per_cpu_s"],
                   "min_cosine": float(cos.min()), "same_token_count": rows[0]["tokens"] == rows[1]["tokens"]}
        print(f"ratio texts/s ours/st: {summary['ratio_texts_per_s']:.2f}   texts per CPU-second ours/st: "
              f"{summary['ratio_texts_per_cpu_s']:.2f}   min cosine ours vs st: "
              f"{summary['min_cosine']:.6f}   same token count: {summary['same_token_count']}")
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = common.configure_threads(args.threads)
    texts = make_texts(args.num_texts, args.max_words, args.seed)
    print(f"workload: {len(texts)} texts, 4..{args.max_words} words (seed {args.seed}); ours: {args.clients} "
          f"clients x calls of {args.call_size} texts, server args {args.server_arg}; st batch {args.st_batch_size}")
    print("threads:", threads)
    rows = [bench_ours(args, texts)]
    if not args.skip_st:
        rows.append(bench_st(args, texts))
    summary = report(rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "threads": threads, "summary": summary,
                       "rows": [{k: v for k, v in r.items() if k != "vectors"} for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
