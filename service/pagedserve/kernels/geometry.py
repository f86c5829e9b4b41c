"""Pure-Python side of the CUDA kernels in ``cuda/``: supported dtypes and sizes, template names and launch plans.

Nothing here touches CUDA, so every function is unit-testable on a CPU-only machine. The constants mirror the
kernels' template parameters; :mod:`pagedserve.kernels.build` builds NVRTC name expressions from them and the
launchers launch with the geometry computed here (argument checks: :mod:`pagedserve.kernels.checks`).

A plan here sets how much work a launch holds, never a row's value: the decode kernel's split-K partitions are
:data:`DECODE_PARTITION` keys at absolute positions whatever the batch, the SM count or a CUDA graph's capacity (the
plans only size the grid to cover them), and the prefill tiles sit at absolute key positions too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32)
COPY_UNITS = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}  # bytes -> CUDA type for the byte movers

DECODE_NUM_WARPS = 4
DECODE_STAGES = 4               # cp.async ring depth per warp
DECODE_GQA_TILES = (1, 2, 4, 8)
DECODE_PARTITION = 256          # tokens per split-K partition, at absolute key positions (kDecodePartition)
PREFILL_NUM_WARPS = 4           # the mma kernel: 16 query rows per warp


def dtype_name(dtype: torch.dtype, arg: str = "dtype") -> str:
    """``torch.float16`` -> ``"float16"``; raises ValueError naming ``arg`` for an unsupported dtype."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{arg}: dtype {dtype} not supported (float16, bfloat16, float32)")
    return SUPPORTED_DTYPES[dtype]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- template names ---------------------------------------------------------------------------------------------
def decode_kernel_name(dtype: str, head_dim: int, block_size: int, gqa_tile: int) -> str:
    return f"paged_decode_kernel<{CTYPES[dtype]}, {head_dim}, {block_size}, {gqa_tile}, {DECODE_NUM_WARPS}>"


def decode_merge_kernel_name(dtype: str, head_dim: int) -> str:
    return f"paged_decode_merge_kernel<{CTYPES[dtype]}, {head_dim}>"


def prefill_block_n(head_dim: int) -> int:
    """Keys per K/V tile of the tensor-core prefill kernel (smaller at head_dim 256 to bound registers/smem)."""
    return 32 if head_dim > 128 else 64


def prefill_kernel_name(dtype: str, head_dim: int, block_size: int, gqa_tile: int = 1) -> str:
    """The prefill instantiation; ``gqa_tile`` (:func:`decode_gqa_tile`) matters for float32 only, whose kernel runs
    the decode kernel's partitions with the decode kernel's GQA tile."""
    if dtype == "float32":
        return f"paged_prefill_fp32_kernel<{head_dim}, {block_size}, {gqa_tile}>"
    return (f"paged_prefill_kernel<{CTYPES[dtype]}, {head_dim}, {block_size}, {PREFILL_NUM_WARPS}, "
            f"{prefill_block_n(head_dim)}>")


def vec_elems(dtype: str) -> int:
    """Elements in one 16-byte vector."""
    return 16 // ELEM_BYTES[dtype]


def rms_norm_kernel_name(dtype: str, vec: int, residual: bool) -> str:
    return f"rms_norm_kernel<{CTYPES[dtype]}, {vec}, {'true' if residual else 'false'}>"


def rotary_kernel_name(dtype: str, is_neox: bool) -> str:
    return f"rotary_embedding_kernel<{CTYPES[dtype]}, {'true' if is_neox else 'false'}>"


def silu_and_mul_kernel_name(dtype: str, vec: int) -> str:
    return f"silu_and_mul_kernel<{CTYPES[dtype]}, {vec}>"


def moe_topk_kernel_name(softmax_first: bool) -> str:
    return f"moe_topk_kernel<{'true' if softmax_first else 'false'}>"


def moe_combine_kernel_name(dtype: str) -> str:
    return f"moe_combine_kernel<{CTYPES[dtype]}>"


MOE_MAX_TOP_K = 64
MOE_TOPK_WARPS = 8   # tokens per block of the router kernel (a warp each)


def reshape_and_cache_kernel_name(unit_bytes: int) -> str:
    return f"reshape_and_cache_kernel<{COPY_UNITS[unit_bytes]}>"


def copy_blocks_kernel_name(unit_bytes: int) -> str:
    return f"copy_blocks_kernel<{COPY_UNITS[unit_bytes]}>"


# ---- launch geometry --------------------------------------------------------------------------------------------
def decode_gqa_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query heads one decode thread block serves per KV head: the group size rounded up to 1/2/4/8 (groups
    larger than 8 take several blocks per KV head)."""
    group = num_heads // num_kv_heads
    return next((t for t in DECODE_GQA_TILES if t >= group), DECODE_GQA_TILES[-1])


def decode_num_partitions(context_len: int, sliding_window: int = 0) -> int:
    """Split-K partitions a decode of context ``context_len`` reads: those of :data:`DECODE_PARTITION` keys at
    absolute positions (partition p holds keys ``[p * 256, p * 256 + 256)``) from the one holding its first key
    (0, or ``context_len - W`` under a sliding window ``W > 0``) to the one holding its last; 0 for an empty context.
    The kernel's ``num_partitions`` (cuda/decode_attention.cu)."""
    if context_len <= 0:
        return 0
    first = max(0, context_len - sliding_window) if sliding_window > 0 else 0
    return (context_len - 1) // DECODE_PARTITION - first // DECODE_PARTITION + 1


def decode_smem_bytes(dtype: str, head_dim: int, block_size: int, gqa_tile: int, rows: int = 1) -> int:
    """Dynamic shared memory of paged_decode_kernel (``rows`` 1): mirrors DecodeLayout::kSmemBytes in
    cuda/decode_chunk.cuh (each warp's cp.async ring of K/V chunks, reused for the cross-warp merge), and of
    attend_partition for ``rows`` query rows (PartitionSmem, cuda/decode_partition.cuh). The kernels trap if
    given less."""
    row_vecs = head_dim // vec_elems(dtype)
    lanes_per_row = min(32, row_vecs)
    vecs_per_lane = row_vecs // lanes_per_row
    steps = min(4 // vecs_per_lane, 16 // gqa_tile, block_size // (32 // lanes_per_row))
    ring = DECODE_NUM_WARPS * DECODE_STAGES * 2 * steps * vecs_per_lane * 32 * 16
    merge = 4 * (DECODE_NUM_WARPS * rows * gqa_tile * head_dim + 2 * DECODE_NUM_WARPS * rows * gqa_tile)
    return max(ring, merge)


def prefill_fp32_rows(head_dim: int, gqa_tile: int) -> int:
    """Query rows per block of paged_prefill_fp32_kernel (PrefillFp32Rows, cuda/prefill_attention_fp32.cu): 8 (head
    dims 64 and 128) or 4 (256) row-heads over the GQA tile, at least 1."""
    elems = 4 if head_dim <= 128 else 8   # row elements per lane of the decode layout in float32
    return max(1, (32 // elems) // gqa_tile)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Launch geometry of one decode batch (shared by every layer of a step). It sets how many blocks run, never
    what a sequence's output is: the partitions are :data:`DECODE_PARTITION` keys at absolute positions whatever
    the plan (cuda/decode_attention.cu)."""

    gqa_tile: int                 # query heads per block (template parameter)
    partition_size: int           # tokens per partition: DECODE_PARTITION, for information
    num_partitions: int           # grid.x: partition slots per sequence (>= every sequence's partitions)
    grid: tuple[int, int, int]    # (slots, num_kv_heads * head tiles, num_seqs)
    block: tuple[int, int, int]
    smem_bytes: int               # dynamic shared memory of the decode kernel
    merge_grid: tuple[int, int, int]
    merge_block: tuple[int, int, int]
    merge_smem_bytes: int         # 0: the merge kernel keeps its state in registers
    sliding_window: int = 0       # the window it was planned for (0: none); the launch must pass the same


def window_read_len(context_len: int, sliding_window: int, block_size: int) -> int:
    """Tokens at the end of a context of ``context_len`` tokens that paged_decode_kernel may read: all of them, or
    under a sliding window ``W > 0`` those from the window's first token ``context_len - W`` rounded down to its
    cache block (the kernel reads from the chunk holding that token, which lies inside that block); at most
    ``W + block_size - 1``. The blocks before it are never read (nor their block-table entries)."""
    if sliding_window <= 0 or context_len <= sliding_window:
        return context_len
    first = context_len - sliding_window
    return context_len - (first - first % block_size)


def _decode_plan(dtype: str, slots: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, sliding_window: int) -> DecodePlan:
    tile = decode_gqa_tile(num_heads, num_kv_heads)
    kv_programs = num_kv_heads * cdiv(num_heads // num_kv_heads, tile)
    return DecodePlan(gqa_tile=tile, partition_size=DECODE_PARTITION, num_partitions=slots,
                      grid=(slots, kv_programs, num_seqs), block=(DECODE_NUM_WARPS * 32, 1, 1),
                      smem_bytes=decode_smem_bytes(dtype, head_dim, block_size, tile),
                      merge_grid=(num_heads, num_seqs, 1), merge_block=(min(head_dim, 256), 1, 1),
                      merge_smem_bytes=0, sliding_window=sliding_window)


def plan_decode(dtype: str, context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, sliding_window: int = 0) -> DecodePlan:
    """Geometry of paged_decode_kernel (+ merge) for ``len(context_lens)`` sequences under ``sliding_window`` (0:
    none): as many partition slots per sequence as the one reading the most partitions needs
    (:func:`decode_num_partitions`), at least 1; the merge kernel runs when that is more than 1. The slots a
    sequence does not need exit at once, so the plan changes the work launched, not any sequence's output."""
    slots = max([1, *(decode_num_partitions(c, sliding_window) for c in context_lens)])
    return _decode_plan(dtype, slots, len(context_lens), num_heads, num_kv_heads, head_dim, block_size,
                        sliding_window)


def plan_decode_fixed(dtype: str, num_seqs: int, max_context_len: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, block_size: int, sliding_window: int = 0) -> DecodePlan:
    """Fixed-grid decode geometry for CUDA graphs: it depends only on the batch size and the context capacity
    ``max_context_len`` (tokens, >= every context length a replay may see, e.g. max_model_len rounded up to whole
    blocks), never on a step's host-side context lengths, so one captured launch serves every replay.

    The grid holds the most partitions a context up to the capacity can read: ``ceil(max_context_len / 256)``, and
    under a ``sliding_window`` W at most ``ceil((W - 1) / 256) + 1`` (a window's keys straddle partition
    boundaries). At replay the kernel reads ``context_lens`` on the device: slots past a sequence's last partition
    exit at once, the merge kernel combines only the partitions that hold keys, and a sequence of context 0 (a padded
    row) gets zeros. The partitions themselves are the fixed ones, so a replayed sequence's output is the same bits
    as an eager launch's, whatever the capacity. Raises ValueError for ``num_seqs < 1`` or ``max_context_len < 1``.
    """
    if num_seqs < 1 or max_context_len < 1:
        raise ValueError(f"plan_decode_fixed: need num_seqs >= 1 and max_context_len >= 1, got {num_seqs}, "
                         f"{max_context_len}")
    slots = cdiv(max_context_len, DECODE_PARTITION)
    if sliding_window > 0:
        slots = min(slots, cdiv(sliding_window - 1, DECODE_PARTITION) + 1)
    return _decode_plan(dtype, slots, num_seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window)


@dataclass(frozen=True, slots=True)
class LaunchGeometry:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int


def plan_prefill(dtype: str, head_dim: int, num_heads: int, num_prefill_seqs: int, max_query_len: int,
                 num_kv_heads: int | None = None, block_size: int = 16) -> LaunchGeometry:
    """Geometry of the prefill kernel: (m-tiles, heads, sequences) blocks and its dynamic shared memory. float32
    (paged_prefill_fp32_kernel, the decode kernel's partitions): (row tiles of :func:`prefill_fp32_rows`, KV heads
    times head tiles, sequences); it needs ``num_kv_heads`` (default: ``num_heads``) and ``block_size``."""
    if dtype == "float32":
        kv_heads = num_kv_heads or num_heads
        tile = decode_gqa_tile(num_heads, kv_heads)
        rows = prefill_fp32_rows(head_dim, tile)
        return LaunchGeometry(grid=(max(1, cdiv(max_query_len, rows)), kv_heads * cdiv(num_heads // kv_heads, tile),
                                    num_prefill_seqs), block=(DECODE_NUM_WARPS * 32, 1, 1),
                              smem_bytes=decode_smem_bytes(dtype, head_dim, block_size, tile, rows))
    block_m, threads = 16 * PREFILL_NUM_WARPS, 32 * PREFILL_NUM_WARPS
    smem = ELEM_BYTES[dtype] * head_dim * (block_m + 2 * prefill_block_n(head_dim))
    return LaunchGeometry(grid=(max(1, cdiv(max_query_len, block_m)), num_heads, num_prefill_seqs),
                          block=(threads, 1, 1), smem_bytes=smem)


def rows_block(num_items: int, max_threads: int = 1024, min_threads: int = 32) -> int:
    """Threads per block for a one-block-per-row kernel with ``num_items`` units of work per row."""
    return max(min_threads, min(max_threads, cdiv(num_items, 32) * 32))


def plan_rows(num_rows: int, items_per_row: int, max_threads: int = 1024) -> LaunchGeometry:
    """One block per row (rms_norm, rotary_embedding, reshape_and_cache)."""
    return LaunchGeometry(grid=(num_rows, 1, 1), block=(rows_block(items_per_row, max_threads), 1, 1), smem_bytes=0)


def plan_silu_and_mul(num_tokens: int, num_vecs: int) -> LaunchGeometry:
    """(tokens, column blocks of 256 threads) for silu_and_mul_kernel over ``num_vecs`` vectors per row."""
    threads = rows_block(num_vecs, 256)
    return LaunchGeometry(grid=(num_tokens, min(cdiv(num_vecs, threads), 65535), 1), block=(threads, 1, 1),
                          smem_bytes=0)


def copy_unit_bytes(*byte_quantities: int) -> int:
    """Widest copy unit (16, 4 or 2 bytes) dividing every address / stride / size in ``byte_quantities``."""
    for unit in (16, 4, 2):
        if all(q % unit == 0 for q in byte_quantities):
            return unit
    raise ValueError(f"byte quantities {byte_quantities} are not 2-byte aligned")


def vec_for_rows(dtype: str, row_elems: int, *byte_quantities: int) -> int:
    """16-byte vector width in elements if ``row_elems`` and every byte quantity allow it, else 1."""
    v = vec_elems(dtype)
    return v if row_elems % v == 0 and all(q % 16 == 0 for q in byte_quantities) else 1
