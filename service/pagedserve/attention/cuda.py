"""CUDA attention backend: the CuPy RawModule kernels of ``cuda/`` behind the :class:`AttentionBackend` interface.

Same semantics as :class:`pagedserve.attention.torch_ref.TorchAttentionBackend` (the oracle): reshape_and_cache
writes the step's new K/V rows, then the first ``num_decode_seqs`` sequences (one new token each) run the paged
decode kernel (GQA-tiled, split-K) and the rest run the paged prefill kernel (causal over the cached prefix and
the new tokens); a layer's sliding window, soft-cap (Gemma 2) and attention sinks (gpt-oss) go to both kernels. The
decode launch plan depends only on the step's metadata and the window, so it is computed once per step and window
and reused by every layer of that window. Under CUDA graph capture (``meta.fixed_context_capacity`` set) the decode plan is the
fixed grid of :func:`pagedserve.kernels.geometry.plan_decode_fixed`, which depends only on the batch size and the
capacity, so a replay with other context lengths launches the same geometry. Neither plan changes a value: the
decode kernel's split-K partitions are 256 keys at absolute positions, so a sequence's attention output is the same
bits whatever its batch-mates, the plan or the graph (cuda/decode_attention.cu; the linears, torch's cuBLAS, are not
batch-invariant).
"""
from __future__ import annotations

import torch

from .. import kernels
from ..kernels import geometry as geo
from ..kernels.checks import check_sliding_window
from .base import AttentionBackend, AttentionMetadata


class CudaAttentionBackend(AttentionBackend):
    """Paged attention on CUDA through :mod:`pagedserve.kernels`. Instances hold only a per-step plan cache."""

    name = "cuda"
    supports_cuda_graphs = True  # fixed-grid decode plan under meta.fixed_context_capacity; no host reads
    elementwise = kernels.CUDA_OPS  # fused RMSNorm + residual, rotary, SiLU-and-mul from cuda/elementwise.cu

    def __init__(self) -> None:
        self._plan_meta: object | None = None   # the step (its metadata, or its KV groups' list) planned for
        self._plans: dict[tuple, geo.DecodePlan] = {}

    def _decode_plan(self, meta: AttentionMetadata, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, device: torch.device, window: int) -> geo.DecodePlan:
        """The step's decode plan for this layer shape and sliding window (0: none), made once per step (the KV
        layer groups' metadata of one step share it: the plan depends on the context lengths, not the tables)."""
        step = meta.groups if meta.groups is not None else meta
        if step is not self._plan_meta:
            self._plans, self._plan_meta = {}, step
        shape = (dtype, num_heads, num_kv_heads, head_dim, block_size, device.index, window)
        if shape not in self._plans:
            nd, name = meta.num_decode_seqs, geo.dtype_name(dtype, "query")
            if meta.fixed_context_capacity is not None:  # CUDA graph capture: geometry from the capacity only
                self._plans[shape] = geo.plan_decode_fixed(name, nd, meta.fixed_context_capacity, num_heads,
                                                           num_kv_heads, head_dim, block_size, window)
            else:
                self._plans[shape] = geo.plan_decode(name, meta.context_lens_cpu[:nd], num_heads, num_kv_heads,
                                                     head_dim, block_size, sliding_window=window)
        return self._plans[shape]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, *, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. Returns a new contiguous ``[T, num_heads, head_dim]``.

        Raises:
            ValueError: on a dtype, shape, stride or device mismatch (before any kernel runs).
        """
        if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0]:
            raise ValueError(f"query/key/value: bad shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}")
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise ValueError(f"key/value: dtype {key.dtype}/{value.dtype} != query dtype {query.dtype}")
        nd, num_seqs = meta.num_decode_seqs, meta.num_seqs
        if not 0 <= nd <= num_seqs:
            raise ValueError(f"meta.num_decode_seqs: {nd} not in [0, {num_seqs}]")
        window = check_sliding_window(sliding_window)
        kernels.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if nd > 0:
            _, block_size, num_kv_heads, head_dim = k_cache.shape
            plan = self._decode_plan(meta, query.dtype, query.shape[1], num_kv_heads, head_dim, block_size,
                                     query.device, window)
            kernels.paged_decode_attention(out[:nd], query[:nd], k_cache, v_cache, meta.block_tables,
                                           meta.context_lens, scale, plan=plan, sliding_window=window or None,
                                           softcap=softcap, sinks=sinks)
        if nd < num_seqs:
            max_query_len = max(meta.query_lens_cpu[nd:])
            kernels.paged_prefill_attention(out, query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                            meta.query_start_loc, scale, seq_offset=nd,
                                            num_prefill_seqs=num_seqs - nd, max_query_len=max_query_len,
                                            sliding_window=window or None, softcap=softcap, sinks=sinks)
        return out

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    block_copies: list[tuple[int, int]]) -> None:
        """Copy-on-write through the ``copy_blocks`` kernel (cuda/cache_ops.cu): all layers and pairs in one launch
        per 65535 pairs. Same result as the base class's index copy."""
        if not block_copies:
            return
        k_caches = [k for k, _ in kv_caches]
        v_caches = [v for _, v in kv_caches]
        mapping = torch.tensor(block_copies, dtype=torch.int64).to(k_caches[0].device)
        for start in range(0, mapping.shape[0], 65535):
            kernels.copy_blocks(k_caches, v_caches, mapping[start:start + 65535].contiguous())


def cuda_backend_error(device: torch.device | str) -> str | None:
    """Why the CUDA backend cannot run on ``device``, or None when it can (torch sees the GPU, it is sm_80 or
    newer, CuPy imports, and a trivial kernel module compiles and launches)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure disqualifies the backend
        return f"cupy does not import: {exc}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (8, 0):
        return "the kernels need compute capability >= 8.0 (cp.async, ldmatrix, bf16 mma)"
    try:
        probe = torch.zeros(1, 8, dtype=torch.float16, device=f"cuda:{index}")
        kernels.silu_and_mul(probe)
        torch.cuda.synchronize(index)
    except Exception as exc:  # noqa: BLE001 - NVRTC / driver / header problems all mean "unusable"
        return f"CUDA kernels failed to compile or launch: {exc}"
    return None
