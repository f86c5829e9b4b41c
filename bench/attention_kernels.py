"""Decode-attention kernel benchmark: achieved bandwidth against a device-to-device copy measured in the same run,
and time against torch SDPA over the same K/V gathered dense through the block tables.

Default shape (issue 5): batch 64, 32 query heads, 8 KV heads, head_dim 128, block size 16, contexts 512..8192,
fp16 and bf16. Goals: >= 80% of the copy bandwidth from context 2048 up; faster than gather + SDPA everywhere.

Timing: CUDA events around ``--iters`` back-to-back launches queued behind a GPU spin (torch.cuda._sleep), so
the host's launch overhead is hidden and the figure is GPU time per call. Bandwidth counts the bytes the kernel
must move: K and V of every context (plus the query and output, negligible); the copy's counts read + write.

Usage: python bench/attention_kernels.py [--contexts 512,1024,2048,4096,8192] [--dtypes float16,bfloat16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from pagedserve import kernels  # noqa: E402
from pagedserve.kernels import geometry as geo  # noqa: E402


def gpu_time_s(fn, iters: int) -> float:
    """Seconds per call of ``fn`` on the current stream, launches queued behind a spin so the GPU runs them back to
    back. The median of 3 repetitions."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # ~25 ms of spinning while the host queues the launches
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return sorted(times)[1]


def copy_bandwidth(num_bytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = gpu_time_s(lambda: dst.copy_(src), iters)
    return 2 * num_bytes / t


def decode_case(dtype: torch.dtype, ctx: int, batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                iters: int) -> dict:
    """Time the decode kernel, gather + SDPA and SDPA alone on one uniform-context batch."""
    blocks_per_seq = ctx // block_size
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, head_dim, device="cuda").to(dtype)
    out = torch.empty_like(query)
    scale = head_dim ** -0.5
    plan = geo.plan_decode(geo.dtype_name(dtype), [ctx] * batch, heads, kv_heads, head_dim, block_size)

    def kernel():
        kernels.paged_decode_attention(out, query, k_cache, v_cache, tables, context_lens, scale, plan=plan)

    def gather():
        idx = tables.long()
        k = k_cache[idx].view(batch, ctx, kv_heads, head_dim).transpose(1, 2)
        v = v_cache[idx].view(batch, ctx, kv_heads, head_dim).transpose(1, 2)
        return k, v

    def gather_sdpa():
        k, v = gather()
        return F.scaled_dot_product_attention(query.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    k_dense, v_dense = (t.contiguous() for t in gather())

    def sdpa_dense():
        return F.scaled_dot_product_attention(query.unsqueeze(2), k_dense, v_dense, scale=scale, enable_gqa=True)

    kernel()
    err = (out.float() - sdpa_dense().squeeze(2).float()).abs().max().item()
    t_kernel = gpu_time_s(kernel, iters)
    t_gather_sdpa = gpu_time_s(gather_sdpa, iters)
    t_sdpa = gpu_time_s(sdpa_dense, iters)
    kv_bytes = 2 * batch * kv_heads * ctx * head_dim * k_cache.element_size()
    io_bytes = 2 * query.numel() * query.element_size()
    del k_cache, v_cache, k_dense, v_dense
    return {"dtype": str(dtype).removeprefix("torch."), "context": ctx, "partitions": plan.num_partitions,
            "kernel_us": t_kernel * 1e6, "bandwidth_gbs": (kv_bytes + io_bytes) / t_kernel / 1e9,
            "gather_sdpa_us": t_gather_sdpa * 1e6, "sdpa_dense_us": t_sdpa * 1e6, "max_abs_err": err}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the rows and verdicts here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention_kernels.py: no CUDA device", file=sys.stderr)
        return 2
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  ({kernels.num_sms(0)} SMs)")
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"decode: batch {args.batch}, {args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
          f"block size {args.block_size}")
    header = (f"{'dtype':>9} {'ctx':>6} {'parts':>5} {'kernel us':>10} {'GB/s':>7} {'% copy':>7} "
              f"{'gather+sdpa us':>15} {'x faster':>9} {'sdpa(dense) us':>15} {'x faster':>9} {'max err':>8}")
    print(header)
    rows = []
    for name in args.dtypes.split(","):
        for ctx in (int(c) for c in args.contexts.split(",")):
            r = decode_case(getattr(torch, name), ctx, args.batch, args.heads, args.kv_heads, args.head_dim,
                            args.block_size, args.iters)
            r["fraction_of_copy"] = r["bandwidth_gbs"] * 1e9 / copy_bw
            rows.append(r)
            print(f"{r['dtype']:>9} {ctx:>6} {r['partitions']:>5} {r['kernel_us']:>10.1f} {r['bandwidth_gbs']:>7.0f} "
                  f"{100 * r['fraction_of_copy']:>6.1f}% {r['gather_sdpa_us']:>15.1f} "
                  f"{r['gather_sdpa_us'] / r['kernel_us']:>9.2f} {r['sdpa_dense_us']:>15.1f} "
                  f"{r['sdpa_dense_us'] / r['kernel_us']:>9.2f} {r['max_abs_err']:>8.1e}")
    bw_goal = all(r["fraction_of_copy"] >= 0.8 for r in rows if r["context"] >= 2048)
    speed_goal = all(r["kernel_us"] < r["gather_sdpa_us"] for r in rows)
    print(f"goal >= 80% of copy bandwidth from context 2048: {'PASS' if bw_goal else 'FAIL'}")
    print(f"goal faster than gather + SDPA at every point: {'PASS' if speed_goal else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbs": copy_bw / 1e9, "rows": rows, "bandwidth_goal": bw_goal,
                                               "speed_goal": speed_goal}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
