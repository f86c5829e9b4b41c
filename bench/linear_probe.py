"""Linear probe: each layer shape of the embedded model at decode (M=1: GB/s of weights read) and in batched steps
(M=16/64: GFLOP/s), torch's kernels against pagedserve's CPU kernels, beside a plain memory copy in the same run.

    .venv/bin/python bench/linear_probe.py [--threads 2] [--layers 30] [--repeats 5]

Every layer shape gets --layers distinct weight copies (as many as the model has), run one after the other, so the
weights stream from memory as in a real step instead of sitting in cache. Weight formats: float32 (``F.linear``
against ``linear_f32``) and the GGUF's Q4_1 as int4 in groups of 32 (torch's ``_weight_int4pack_mm_for_cpu`` through
``Int4Linear``, bfloat16 activations, against ``linear_q4``); the LM head (49152 x 576, tied to the Q8_0 embedding)
in float32 and as Q8_0 (torch: int8 per channel ``_weight_int8pack_mm``; ours: ``linear_q8``).

Copy bandwidth: ``dst.copy_(src)`` of 512 MiB, counted as bytes read + bytes written (so "60% of the copy bandwidth"
for a GEMV means reading its weights at 0.6x that figure). Weight GB/s counts the bytes of the stored format
(codes and scales).
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
from pagedserve.models.cpu_linear import StreamingInt4Linear, StreamingInt8Linear  # noqa: E402
from pagedserve.models.quant import (Int4Linear, Int8BlockWeight, Int8Linear, quantize_int4,  # noqa: E402
                                     quantize_int8_per_channel)

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
LM_HEAD = (49152, 576)


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds per call of each function, the functions taking turns (one call each per round), so load
    from other processes hits every one alike."""
    for fn in fns.values():
        fn()
    samples = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    return {key: statistics.median(v) for key, v in samples.items()}


def copy_bandwidth(repeats: int) -> float:
    src = torch.randn(128 * 2**20)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), repeats)


def layer_copies(n: int, k: int, count: int):
    """``count`` random float32 weights [n, k] with their int4 (group 32) layers built both ways."""
    out = []
    for _ in range(count):
        w = torch.randn(n, k) * 0.05
        q = quantize_int4(w, 32)
        out.append((w, Int4Linear(q), StreamingInt4Linear(q), q.codes.numel() // 2 + 8 * q.scales.numel()))
    return out


def run_shape(name, copies, ms, repeats):
    n, k = copies[0][0].shape
    f32_bytes = n * k * 4 * len(copies)
    q4_bytes = sum(c[3] for c in copies)
    for m in ms:
        x = torch.randn(m, k)
        t = interleaved({
            "f32 torch": lambda: [F.linear(x, c[0]) for c in copies],
            "f32 ours": lambda: [torch.ops.pagedserve_cpu.linear_f32(x, c[0], None) for c in copies],
            "q4 torch": lambda: [c[1](x) for c in copies],
            "q4 ours": lambda: [c[2](x) for c in copies],
        }, repeats)
        yield name, m, t, f32_bytes, q4_bytes, 2 * m * n * k * len(copies)


def report(name, m, t, f32_bytes, q4_bytes, flops, copy_bw):
    parts = []
    for key, seconds in t.items():
        nbytes = f32_bytes if key.startswith("f32") else q4_bytes
        if m == 1:
            parts.append(f"{key} {nbytes / seconds / 1e9:5.1f} GB/s ({nbytes / seconds / copy_bw:4.0%})")
        else:
            parts.append(f"{key} {flops / seconds / 1e9:5.1f} GFLOP/s")
    ratio_f32, ratio_q4 = t["f32 torch"] / t["f32 ours"], t["q4 torch"] / t["q4 ours"]
    print(f"{name:13s} M={m:<3d} " + " | ".join(parts) + f" | ours/torch speed f32 {ratio_f32:.2f}x q4 {ratio_q4:.2f}x",
          flush=True)


def lm_head(ms, repeats, copy_bw):
    n, k = LM_HEAD
    w = torch.randn(n, k) * 0.05
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    blocks = Int8BlockWeight(codes, (torch.rand(n, k // 32) / 100).half())
    torch_q8, ours_q8 = Int8Linear(quantize_int8_per_channel(blocks.dequantize())), StreamingInt8Linear(blocks)
    q8_bytes = n * k + n * (k // 32) * 2
    for m in ms:
        x = torch.randn(m, k)
        t = interleaved({"f32 torch": lambda: F.linear(x, w),
                         "f32 ours": lambda: torch.ops.pagedserve_cpu.linear_f32(x, w, None),
                         "q8 torch (per channel)": lambda: torch_q8(x),
                         "q8 ours (Q8_0)": lambda: ours_q8(x)}, repeats)
        cells = []
        for key, s in t.items():
            nbytes = n * k * 4 if key.startswith("f32") else q8_bytes
            cells.append(f"{key} {s * 1e3:6.2f} ms" + (f" {nbytes / s / 1e9:5.1f} GB/s ({nbytes / s / copy_bw:4.0%})"
                                                        if m == 1 else ""))
        print(f"lm_head       M={m:<3d} " + " | ".join(cells), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--layers", type=int, default=30, help="weight copies per shape (the model's layer count)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_kernel_ops() is None:
        sys.exit("pagedserve's CPU kernels are unavailable on this machine (see the log line above)")
    copy_bw = copy_bandwidth(args.repeats)
    print(f"threads {args.threads}, torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; memory copy {copy_bw / 1e9:.1f} GB/s (read + write)")
    for name, (n, k) in SHAPES.items():
        copies = layer_copies(n, k, args.layers)
        for row in run_shape(name, copies, args.tokens, args.repeats):
            report(*row, copy_bw)
        del copies
    lm_head(args.tokens, args.repeats, copy_bw)
    print(f"memory copy again {copy_bandwidth(args.repeats) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
