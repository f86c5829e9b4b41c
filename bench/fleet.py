"""Fleet benchmark: two replicas behind vllm-router, cache_aware vs round_robin, in one run.

    python bench/fleet.py [--system-words 600] [--turns 12] [--num-kv-blocks 100] [--concurrency 2]

Workload: 3 long shared system prompts x ``--turns`` short user turns each (a different question every turn),
sent as streaming chat completions through the router, the prompts interleaved (turn t of prompt 0, 1, 2, then
turn t + 1 ...), ``--concurrency`` at a time. For each policy a fresh fleet (:class:`pagedserve.fleet.local.Fleet`:
two ``pagedserve serve`` processes with the embedded model, CPU, one thread each, ``--num-kv-blocks`` KV blocks
each, and the router in front) runs the same workload after one warm-up request per replica (sent to the replica
directly, with a prompt sharing nothing with the workload).

Reported per policy:
- prefix-cache hit rate: ``pagedserve:prefix_cache_hits_total`` over ``pagedserve:prefix_cache_queries_total``
  (prompt tokens), both summed over the replicas' ``/metrics``, as the increase over the workload;
- TTFT p50 / p90: client side, from sending the request to the router to the first chunk with content;
- requests per replica (``pagedserve:e2e_request_latency_seconds_count``) and the wall time.

The KV cache is sized (``--num-kv-blocks``) to hold about two of the three system prompts per replica: round
robin sends every prompt to both replicas, so each replica cycles through all three and evicts what it will need
next; cache_aware keeps each prompt on one replica, so the fleet holds all three. With a KV cache that holds all
three everywhere, round robin misses only the first turn of each prompt on each replica, and the gap shrinks to
that (``--num-kv-blocks 130`` or ``0``, the engine's default size, run that case; figures in bench/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two replicas on a small machine: one intra-op thread each

import httpx  # noqa: E402

from pagedserve.fleet.local import Fleet, free_port_pair  # noqa: E402

WORDS = ("cache block token prefix router replica engine batch kernel tensor queue stream latency policy metric "
         "scheduler decode prefill sample logits vocabulary paged memory thread socket health circuit breaker "
         "retry budget window label selector service deployment probe container image sidecar cluster").split()


def system_prompts(num_words: int, count: int = 3) -> list[str]:
    """``count`` long system prompts, each of ``num_words`` seeded-random words after a distinct first line."""
    out = []
    for j in range(count):
        rng = random.Random(j)
        body = " ".join(rng.choice(WORDS) for _ in range(num_words))
        out.append(f"You are support assistant number {j}. Use this reference when you answer:\n{body}")
    return out


def workload(prompts: list[str], turns: int) -> list[list[dict]]:
    """Chat message lists, interleaved across the system prompts."""
    return [[{"role": "system", "content": prompts[j]}, {"role": "user", "content": f"Question {t}: what is {t}?"}]
            for t in range(turns) for j in range(len(prompts))]


def ttft_s(client: httpx.Client, messages: list[dict], max_tokens: int) -> float:
    """Seconds from sending a streaming chat request to its first chunk with content (or its end)."""
    start = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                              "stream": True, "ignore_eos": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"] and \
                    json.loads(line[6:])["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


NAMES = ("pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total",
         "pagedserve:e2e_request_latency_seconds_count")


def snapshot(fleet: Fleet) -> list[dict[str, float]]:
    return [{n: metric(fleet.http_url(i), n) for n in NAMES} for i in range(fleet.num_replicas)]


def run_policy(policy: str, args, conversations: list[list[dict]]) -> dict:
    serve_args = ["--embedding-model", "none", "--device", "cpu", "--max-num-seqs", "4"]
    if args.num_kv_blocks:
        serve_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    with Fleet(2, serve_args, http_base_port=free_port_pair(), grpc_base_port=free_port_pair(),
               router_port=free_port_pair(), prometheus_port=free_port_pair(), policy=policy) as fleet:
        fleet.start()
        for i in range(fleet.num_replicas):  # warm-up, straight to each replica
            httpx.post(fleet.http_url(i) + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                       timeout=300).raise_for_status()
        before = snapshot(fleet)
        start = time.perf_counter()
        with httpx.Client(base_url=fleet.router_url, timeout=600) as client, \
                ThreadPoolExecutor(args.concurrency) as pool:
            ttfts = list(pool.map(lambda m: ttft_s(client, m, args.max_tokens), conversations))
        wall_s = time.perf_counter() - start
        after = snapshot(fleet)
    delta = [{n: a[n] - b[n] for n in NAMES} for a, b in zip(after, before)]
    queries = sum(d[NAMES[0]] for d in delta)
    hits = sum(d[NAMES[1]] for d in delta)
    quantiles = statistics.quantiles(ttfts, n=10)
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits,
            "query_tokens": queries, "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": quantiles[8],
            "requests_per_replica": [int(d[NAMES[2]]) for d in delta], "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-words", type=int, default=600, help="words per system prompt")
    parser.add_argument("--turns", type=int, default=12, help="user turns per system prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=100, help="per replica (16 tokens each); 0: default")
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    args = parser.parse_args()
    conversations = workload(system_prompts(args.system_words), args.turns)
    print(f"{len(conversations)} requests: 3 system prompts x {args.turns} turns, {args.system_words} words each; "
          f"2 replicas, {args.num_kv_blocks or 'default'} KV blocks each, concurrency {args.concurrency}", flush=True)
    results = [run_policy(p, args, conversations) for p in args.policies]
    print(f"{'policy':<12} {'hit rate':>9} {'hit/query tokens':>18} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'per replica':>12} {'wall':>7}")
    for r in results:
        print(f"{r['policy']:<12} {r['hit_rate']:>9.3f} {int(r['hit_tokens']):>8}/{int(r['query_tokens']):<9} "
              f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>8.3f}s {str(r['requests_per_replica']):>12} "
              f"{r['wall_s']:>6.1f}s")
    by = {r["policy"]: r for r in results}
    if {"cache_aware", "round_robin"} <= by.keys():
        ca, rr = by["cache_aware"], by["round_robin"]
        ratio = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
        print(f"cache_aware / round_robin: hit rate x{ratio:.2f}, TTFT p50 x{ca['ttft_p50_s'] / rr['ttft_p50_s']:.2f}")


if __name__ == "__main__":
    main()
