"""Per-step cost of tensor parallelism on CPU (gloo): a SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9/3
heads; random weights, so nothing is loaded) at size 1 and at size 3 (3 spawned ranks on this machine).

For each batch of B decodes (context 128 each) it times, on rank 0, the median over --iters of:
- ``forward+logits``: one decode step (model forward + LM head) at size 1 (the baseline, same script) and size 3;
- ``collectives``: the collectives of one step alone at size 3: the step message broadcast (pickled CPU tensors
  on the control group), 61 all-reduces of ``[B, 576]`` fp32 (embedding + 2 per layer), and the logits gather.

    .venv/bin/python bench/tp_step.py --iters 20 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tests")

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64)
CONTEXT, BLOCK = 128, 16


def decode_inputs(batch: int):
    from pagedserve.attention.base import AttentionMetadata

    nb = CONTEXT // BLOCK
    i32 = dict(dtype=torch.int32)
    tables = torch.arange(batch * nb, **i32).view(batch, nb)
    meta = AttentionMetadata(
        slot_mapping=tables[:, -1].long() * BLOCK + (CONTEXT - 1) % BLOCK, block_tables=tables,
        context_lens=torch.full((batch,), CONTEXT, **i32), query_start_loc=torch.arange(batch + 1, **i32),
        query_lens=torch.ones(batch, **i32), max_query_len=1, max_context_len=CONTEXT, num_decode_seqs=batch,
        query_lens_cpu=[1] * batch, context_lens_cpu=[CONTEXT] * batch)
    return torch.randint(0, 49152, (batch,)), torch.full((batch,), CONTEXT - 1), meta, batch * nb


def build(tp):
    from transformers import LlamaConfig

    from pagedserve.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(**SHAPE, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(tp.rank)
    model = LlamaForCausalLM(cfg, tp) if tp.size > 1 else LlamaForCausalLM(cfg)
    if tp.size > 1:
        model.lm_head.linear.weight = model.embed_tokens.embedding.weight
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def time_steps(tp, batch: int, iters: int, control=None) -> dict[str, float]:
    from pagedserve.attention.torch_ref import TorchAttentionBackend
    from pagedserve.worker.kv_tensors import allocate_kv_caches
    from pagedserve.executor import group

    model, backend = build(tp), TorchAttentionBackend()
    ids, pos, meta, blocks = decode_inputs(batch)
    kv = allocate_kv_caches(model.num_layers, blocks, BLOCK, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    hidden = torch.randn(batch, 576)
    step, coll = [], []
    for _ in range(iters):
        if tp.size > 1:
            dist.barrier(group=control)
        t = time.perf_counter()
        if control is not None:
            group.receive(control) if tp.rank else group.send(control, ("forward", ids, pos, meta))
        model.compute_logits(model(ids, pos, kv, meta, backend))
        step.append(time.perf_counter() - t)
        if tp.size > 1:
            dist.barrier(group=control)
            t = time.perf_counter()
            group.receive(control) if tp.rank else group.send(control, ("forward", ids, pos, meta))
            for _ in range(2 * model.num_layers + 1):
                tp.all_reduce(hidden.clone())
            tp.gather_rows_last_dim(torch.randn(batch, model.lm_head.local_vocab))
            coll.append(time.perf_counter() - t)
    out = {"forward+logits_ms": 1e3 * statistics.median(step)}
    if coll:
        out["collectives_ms"] = 1e3 * statistics.median(coll)
    return out


def rank_main(rank: int, size: int, port: int, batches, iters: int, threads: int, results) -> None:
    from pagedserve.models.layers import TPGroup

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=300))
    control = dist.new_group(backend="gloo")
    tp = TPGroup(rank, size)
    for b in batches:
        r = time_steps(tp, b, iters, control)
        if rank == 0:
            results.put((b, r))
    dist.destroy_process_group()


def main() -> None:
    import multiprocessing

    from pagedserve.executor.tensor_parallel import free_port
    from pagedserve.models.layers import SINGLE

    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (and of the size-1 run)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads per rank: {args.threads}; context {CONTEXT}; median of {args.iters} steps")
    for b in args.batches:
        print(f"size 1  batch {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in time_steps(SINGLE, b, args.iters).items()))
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 3, port, args.batches, args.iters, args.threads, results))
             for r in range(3)]
    for proc in procs:
        proc.start()
    for _ in args.batches:
        b, r = results.get(timeout=1800)
        print(f"size 3  batch {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    for proc in procs:
        proc.join()


if __name__ == "__main__":
    main()
