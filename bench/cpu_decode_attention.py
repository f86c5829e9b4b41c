"""The CPU paged decode-attention kernel (kernels/csrc/attention_lanes.hpp) at decode batches, side by side in one
process with torch SDPA over the same K/V gathered dense through the block tables (the baseline), and, on an
AVX-512 CPU, with the kernel's AVX2 code (``paged_attention_avx512`` off: what an AVX2-only CPU runs; same values).

    .venv/bin/python bench/cpu_decode_attention.py [--threads 2] [--layers 8] [--repeats 5]
        [--cases 1x4096 8x1024 32x300 32x1024] [--dtypes float32 bfloat16]

A case SxC is S decoding sequences with contexts drawn in [C/2, C] (one sequence: exactly C), the embedded model's
attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16 in a shuffled block table). Each case gets
``--layers`` distinct KV caches called one after the other, so K and V stream from memory as in a decode step
(30 layers of a 32 x 1,024 batch hold 1.1 GB of float32 KV; one layer's fits a 32 MB L3). The paths take turns,
repeat by repeat. Prints microseconds per layer (median of ``--repeats``), the KV bytes read per second, and the
ratios; checks the kernel against SDPA (max |diff|) and the AVX2 code against the native code (bit for bit).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "service"))

from pagedserve.kernels.cpu_build import cpu_kernel_ops  # noqa: E402

H, HKV, D, BS = 9, 3, 64, 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--layers", type=int, default=8, help="distinct KV caches per case, called in turn")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", nargs="+", default=["1x4096", "8x1024", "32x300", "32x1024"],
                   help="SxC: S sequences, contexts in [C/2, C]")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="KV cache dtypes")
    return p.parse_args(argv)


def build_case(seqs: int, ctx: int, dtype: torch.dtype, layers: int, seed: int = 0) -> dict:
    """Random caches [blocks, BS, HKV, D] per layer, one shuffled block table [seqs, ctx / BS], queries [seqs, H, D],
    context lengths int32 [seqs]."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // BS)
    blocks = seqs * per_seq
    caches = [tuple(torch.randn(blocks, BS, HKV, D, generator=gen).to(dtype) for _ in range(2)) for _ in range(layers)]
    lens = (torch.full((seqs,), ctx) if seqs == 1 else torch.randint(ctx // 2, ctx + 1, (seqs,), generator=gen))
    return dict(caches=caches, table=torch.randperm(blocks, generator=gen).to(torch.int32).view(seqs, per_seq),
                q=torch.randn(seqs, H, D, generator=gen), lens=lens.to(torch.int32))


def kernel(case: dict) -> list[torch.Tensor]:
    """Every layer's decode attention on the C++ kernel: [seqs, H, D] float32 each."""
    op = torch.ops.pagedserve_cpu.paged_decode_attention
    return [op(case["q"], k, v, case["table"], case["lens"], D ** -0.5) for k, v in case["caches"]]


def sdpa(case: dict) -> list[torch.Tensor]:
    """The baseline: each sequence's K/V gathered through its block table, then F.scaled_dot_product_attention
    (float32, grouped heads expanded by enable_gqa)."""
    out = []
    for k_cache, v_cache in case["caches"]:
        rows = []
        for s, n in enumerate(case["lens"].tolist()):
            blocks = case["table"][s, :-(-n // BS)].long()
            k = k_cache[blocks].reshape(-1, HKV, D)[:n].float().transpose(0, 1)
            v = v_cache[blocks].reshape(-1, HKV, D)[:n].float().transpose(0, 1)
            rows.append(F.scaled_dot_product_attention(case["q"][s][:, None], k, v, enable_gqa=True)[:, 0])
        out.append(torch.stack(rows))
    return out


def avx2_code(case: dict) -> list[torch.Tensor]:
    """kernel() on the AVX2 code (paged_attention_avx512 off), the AVX-512 code turned back on after."""
    switch = torch.ops.pagedserve_cpu.paged_attention_avx512
    switch(0)
    try:
        return kernel(case)
    finally:
        switch(1)


def timed(fn, case: dict) -> float:
    start = time.perf_counter()
    fn(case)
    return time.perf_counter() - start


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_kernel_ops() is None:
        raise SystemExit("the CPU kernels did not load (AVX2 + FMA and a C++ compiler needed)")
    native = "AVX-512" if torch.ops.pagedserve_cpu.paged_attention_lanes() == 16 else "AVX2"
    paths = {"kernel": kernel, "sdpa": sdpa}
    if native == "AVX-512":
        paths["kernel-avx2"] = avx2_code
    print(f"threads {args.threads}, native code {native}, {args.layers} layers per case, "
          f"shape {H} heads / {HKV} KV heads / head_dim {D}, blocks of {BS}")
    print(f"{'case':>9} {'kv':>9} " + " ".join(f"{name + ' us':>15}" for name in paths) +
          f" {'kernel GB/s':>11} {'sdpa/kernel':>11}" + (" avx2/native" if len(paths) > 2 else "") + "  checks")
    for spec in args.cases:
        seqs, ctx = (int(x) for x in spec.split("x"))
        for dtype_name in args.dtypes:
            case = build_case(seqs, ctx, getattr(torch, dtype_name), args.layers)
            times = {name: [] for name in paths}
            for name, fn in paths.items():
                fn(case)   # warm-up
            for _ in range(args.repeats):
                for name, fn in paths.items():
                    times[name].append(timed(fn, case) / args.layers)
            us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
            got, ref = kernel(case), sdpa(case)
            err = max((a - b).abs().max().item() for a, b in zip(got, ref))
            checks = f"max|kernel-sdpa| {err:.1e}"
            if "kernel-avx2" in paths:
                checks += ", avx2 bits " + ("equal" if all(map(torch.equal, got, avx2_code(case))) else "DIFFER")
            kv_bytes = 2 * int(case["lens"].sum()) * HKV * D * case["caches"][0][0].element_size()
            row = f"{spec:>9} {dtype_name:>9} " + " ".join(f"{us[name]:15.1f}" for name in paths)
            row += f" {kv_bytes / us['kernel'] / 1e3:11.1f} {us['sdpa'] / us['kernel']:11.2f}"
            if "kernel-avx2" in paths:
                row += f" {us['kernel-avx2'] / us['kernel']:11.2f}"
            print(row + "  " + checks, flush=True)


if __name__ == "__main__":
    main()
