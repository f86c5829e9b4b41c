"""The int4 linears' paths at decode-sized token counts, side by side in one process: float32 activations
(``linear_q4``), int8 activations on the AVX2 tiles (``linear_q4_a8``), on AMX tiles (``linear_q4_amx``, where the
CPU has AMX-INT8) and on the AVX-512 VNNI panels (``linear_q4_vnni``, where the CPU has it), one and two levels.

    .venv/bin/python bench/decode_linears.py [--threads 2] [--tokens 1 4 16 32 64] [--layers 30] [--repeats 5]

Each shape of the embedded model (SmolLM2-135M: qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536)
gets ``--layers`` distinct random Q4 weights (group 32), called one after the other, so the weights stream from
memory as in a decode step; the paths take turns, repeat by repeat, so load from other processes hits them alike.
Prints microseconds per call (median of ``--repeats``), each path's ratio to ``linear_q4`` and which is fastest,
then the largest error of each path against the float64 product of the dequantized weight on one call. This is the
measurement behind ``cpu_linear.VNNI_MAX_TOKENS`` (the token count up to which "auto" takes the VNNI panels).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "service"))

from pagedserve.kernels.cpu_build import cpu_kernel_ops  # noqa: E402
from pagedserve.models.cpu_linear import StreamingInt4Linear, amx_available, vnni_available  # noqa: E402
from pagedserve.models.quant import quantize_int4  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32, 64], help="token counts M")
    p.add_argument("--layers", type=int, default=30, help="distinct weights per shape (the model has 30 layers)")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def paths(layer: StreamingInt4Linear) -> dict:
    """name -> fn(x) for every path this CPU runs."""
    ops = torch.ops.pagedserve_cpu
    args = (layer.codes, layer.scales, layer.mins, layer.group_size, None)
    out = {"q4 float": lambda x: ops.linear_q4(x, *args),
           "a8 x2": lambda x: ops.linear_q4_a8(x, *args, 2)}
    if amx_available():
        out["amx x2"] = lambda x: ops.linear_q4_amx(x, *args, 2)
    if vnni_available():
        packed = ops.pack_q4_vnni(layer.codes, layer.scales, layer.mins, layer.group_size)
        n = layer.out_features
        out["vnni x1"] = lambda x: ops.linear_q4_vnni(x, *packed, n, None, 1)
        out["vnni x2"] = lambda x: ops.linear_q4_vnni(x, *packed, n, None, 2)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if cpu_kernel_ops() is None:
        print("pagedserve's CPU kernels did not load here")
        return 1
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}, {args.layers} weights per shape, median of {args.repeats}; us per call "
          f"(ratio to q4 float); AMX {'yes' if amx_available() else 'no'}, VNNI {'yes' if vnni_available() else 'no'}")
    for name, (n, k) in SHAPES.items():
        layers = [StreamingInt4Linear(quantize_int4(torch.randn(n, k, generator=gen) * 0.05, 32))
                  for _ in range(args.layers)]
        fns = [paths(layer) for layer in layers]
        names = list(fns[0])
        for m in args.tokens:
            x = torch.randn(m, k, generator=gen)
            times = {p: [] for p in names}
            for _ in range(args.repeats):
                for p in names:
                    start = time.perf_counter()
                    for f in fns:
                        f[p](x)
                    times[p].append((time.perf_counter() - start) / len(fns) * 1e6)
            med = {p: statistics.median(v) for p, v in times.items()}
            base = med["q4 float"]
            cells = "  ".join(f"{p} {t:8.1f} ({t / base:4.2f})" for p, t in med.items())
            print(f"{name:8s} {n:5d} x {k:4d}  M={m:4d}  {cells}  fastest: {min(med, key=med.get)}")
        exact = torch.randn(4, k, generator=gen)
        want = exact.double() @ layers[0].dequantize().double().T
        errs = "  ".join(f"{p} {(fns[0][p](exact).double() - want).abs().max().item():.2e}" for p in names)
        print(f"{name:8s} max |error| vs float64 (M=4): {errs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
