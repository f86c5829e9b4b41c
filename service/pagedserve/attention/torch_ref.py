"""Reference paged attention in plain torch: the oracle for the CUDA kernels and the CPU path.

Semantics are those of :class:`pagedserve.attention.base.AttentionBackend`. Decodes (one new token each) run as
batched SDPA over K/V gathered through the block tables, in groups of similar context length; prefill chunks run
one sequence at a time with a causal mask offset by the cached prefix length (plain ``is_causal`` over the new rows
when there is no cached prefix). A sliding window narrows both masks to the window's keys; a prefill chunk then
reads only the keys from its first row's window start on. Soft-capped scores (Gemma 2) and attention sinks
(gpt-oss), which SDPA does not take, run the same groups and chunks through :func:`softmax_attention`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.checks import check_sliding_window, check_softcap_sinks
from .base import AttentionBackend, AttentionMetadata


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into the paged cache in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64; slot ``s`` is block ``s // block_size``, offset ``s % block_size``; ``s < 0``
            is padding and is skipped.

    A cache of another float dtype than the rows (``--kv-cache-dtype``) gets them rounded to its dtype (``.to``).
    """
    valid = slot_mapping >= 0
    slots = slot_mapping if bool(valid.all()) else slot_mapping[valid]
    if not bool(valid.all()):
        key, value = key[valid], value[valid]
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Read one sequence's first ``num_tokens`` rows from the paged cache.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[max_blocks]`` int32 physical block ids.
        num_tokens: context length to read.

    Returns:
        ``[num_tokens, num_kv_heads, head_dim]`` (a copy).
    """
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    rows = cache.index_select(0, block_table[:num_blocks].long())  # (index_select: ~2x advanced indexing on CPU)
    return rows.view(num_blocks * block_size, *cache.shape[2:])[:num_tokens]


class Workspace:
    """Two growable scratch buffers for gathered K and V blocks (reused by every layer and step)."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def kv_buffers(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, *like.shape[1:]]`` of the K and V buffers, ``like``'s dtype and device."""
        numel = num_blocks * like[0].numel()
        if self._k is None or self._k.numel() < numel or self._k.dtype != like.dtype or \
                self._k.device != like.device:
            self._k = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._v = torch.empty(numel, dtype=like.dtype, device=like.device)
        shape = (num_blocks, *like.shape[1:])
        return self._k[:numel].view(shape), self._v[:numel].view(shape)


DECODE_GROUP_OVERHEAD_ROWS = 1024  # fixed cost of one more decode group, in padded K/V rows (measured on CPU)


@dataclass(slots=True)
class _DecodeGroup:
    start: int                 # first decode row of the group
    end: int                   # one past its last row
    tables: torch.Tensor       # [(end - start) * num_blocks] int64 block ids, row by row; num_blocks covers the
                               # group's longest context
    mask: torch.Tensor         # [end - start, 1, 1, num_blocks * block_size] bool, True where a key is in context


@dataclass(slots=True)
class StepPlan:
    """What every layer of one step reuses: decode groups, and the causal mask of each prefill chunk (None when
    the chunk is the whole context, which runs as ``is_causal``); the masks of a sliding window are built on first
    use (:meth:`window_masks`) and kept for the step's other layers of that window."""

    decode_groups: list[_DecodeGroup]
    prefill_masks: list[torch.Tensor | None]
    query_starts: list[int]
    meta: AttentionMetadata | None = None
    _windowed: dict = field(default_factory=dict)

    def window_masks(self, window: int | None) -> tuple[list[torch.Tensor], list[tuple[int, torch.Tensor | None]]]:
        """(mask of each decode group, (first key, mask) of each prefill chunk) under ``window`` (None: the causal
        masks, first key 0). A decode group's mask keeps keys ``ctx - window .. ctx - 1``; prefill row ``r`` at
        position ``p`` keeps keys ``p - window + 1 .. p``, its mask's columns starting at the chunk's first key
        ``max(0, first row's position - window + 1)``; a chunk whose context fits in the window keeps its causal
        mask."""
        if window is None:
            return [g.mask for g in self.decode_groups], [(0, m) for m in self.prefill_masks]
        if window not in self._windowed:
            self._windowed[window] = self._build_window_masks(window)
        return self._windowed[window]

    def _build_window_masks(self, window: int):
        meta = self.meta
        lens = meta.context_lens_cpu
        decode = []
        for g in self.decode_groups:
            if max(lens[g.start:g.end]) <= window:
                decode.append(g.mask)
                continue
            keys = torch.arange(g.mask.shape[-1], device=g.mask.device)[None, :]
            ctx = meta.context_lens[g.start:g.end, None]
            decode.append(((keys < ctx) & (keys >= ctx - window))[:, None, None, :])
        prefill = []
        for i, causal in zip(range(meta.num_decode_seqs, meta.num_seqs), self.prefill_masks):
            q_len, ctx_len = meta.query_lens_cpu[i], lens[i]
            if ctx_len <= window:
                prefill.append((0, causal))
                continue
            first = max(0, ctx_len - q_len - window + 1)
            device = meta.block_tables.device
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
            keys = torch.arange(first, ctx_len, device=device)[None, :]
            prefill.append((first, (keys <= q_pos) & (keys > q_pos - window)))
        return decode, prefill


def plan_step(meta: AttentionMetadata, block_size: int) -> StepPlan:
    """Build the per-step plan of :func:`paged_attention_ref`.

    Decodes are split into contiguous groups so that a short context is not padded to a much longer one: reading
    rows in order, a new group starts at row i when the padding the remaining rows would save by it,
    ``(group's longest - context_lens[i]) * rows left``, exceeds :data:`DECODE_GROUP_OVERHEAD_ROWS`. The model
    runner orders decodes by context length, longest first, so the groups nest tightly; any order is correct.
    """
    device = meta.block_tables.device
    nd = meta.num_decode_seqs
    lens = meta.context_lens_cpu
    bounds, start, longest = [], 0, 0
    for i in range(nd):
        if i > start and (longest - lens[i]) * (nd - i) > DECODE_GROUP_OVERHEAD_ROWS and lens[i] <= longest:
            bounds.append((start, i, longest))
            start, longest = i, 0
        longest = max(longest, lens[i])
    if nd:
        bounds.append((start, nd, longest))
    groups = []
    for a, b, longest in bounds:
        num_blocks = (longest + block_size - 1) // block_size
        mask = torch.arange(num_blocks * block_size, device=device)[None, :] < meta.context_lens[a:b, None]
        groups.append(_DecodeGroup(a, b, meta.block_tables[a:b, :num_blocks].reshape(-1).long(),
                                   mask[:, None, None, :]))
    masks = []
    for i in range(nd, meta.num_seqs):
        q_len, ctx_len = meta.query_lens_cpu[i], lens[i]
        if q_len == ctx_len:
            masks.append(None)
            continue
        # Query row r sits at absolute position ctx_len - q_len + r and sees keys 0..that position.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
        masks.append(torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None])
    starts = meta.query_start_loc.tolist() if nd < meta.num_seqs else []
    return StepPlan(groups, masks, starts, meta)


#: query rows of one prefill chunk scored at once by :func:`softmax_attention` (bounds its float32 score matrix)
MATH_QUERY_ROWS = 256


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out in float32, for what SDPA does not take.

    ``scores = scale * q k^T``; with ``softcap`` c, ``c * tanh(scores / c)`` (Gemma 2, Gemma Team 2024; HF
    transformers' ``eager_attention_forward`` of ``Gemma2Attention``); masked keys get -inf; with ``sinks``, one more
    logit per row that joins the softmax's denominator and is dropped after it (gpt-oss's attention sinks, HF
    ``GptOssAttention``; Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks").

    Args:
        q: ``[B, Hkv, R, D]``: R query rows per KV head (GQA's query heads folded into the rows).
        k, v: ``[B, Hkv, S, D]``.
        mask: bool, broadcastable to ``[B, Hkv, R, S]``, True where a key is seen.
        sinks: None, or float32 broadcastable to ``[B, Hkv, R, 1]`` (each row's head's sink logit).

    Returns:
        ``[B, Hkv, R, D]`` float32.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float())


def _prefill_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One prefill chunk through :func:`softmax_attention`: ``q`` ``[L, H, D]``, ``k``/``v`` ``[S, Hkv, D]``, ``mask``
    ``[L, S]`` (None: causal, L == S); returns ``[L, H, D]`` float32, :data:`MATH_QUERY_ROWS` rows at a time."""
    L, H, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    G = H // Hkv
    if mask is None:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
    kt, vt = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]            # [1, Hkv, S, D]
    sink = None if sinks is None else sinks.float().view(1, Hkv, G, 1, 1)
    out = torch.empty(L, H, D, dtype=torch.float32, device=q.device)
    for a in range(0, L, MATH_QUERY_ROWS):
        b = min(L, a + MATH_QUERY_ROWS)
        n = b - a
        qc = q[a:b].permute(1, 0, 2).reshape(1, Hkv, G * n, D)             # rows: head g of KV head j, then row
        mc = mask[a:b][None, None].expand(1, G, n, S).reshape(1, 1, G * n, S)
        sc = None if sink is None else sink.expand(1, Hkv, G, n, 1).reshape(1, Hkv, G * n, 1)
        o = softmax_attention(qc, kt, vt, mc, scale, softcap, sc)          # [1, Hkv, G * n, D]
        out[a:b] = o.view(H, n, D).transpose(0, 1)
    return out


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, plan: StepPlan | None = None,
                        key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                        workspace: Workspace | None = None, prefill_dtype: torch.dtype | None = None,
                        sliding_window: int | None = None, decodes: bool = True, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's new tokens over their paged contexts (no cache write).

    Args:
        query: ``[T, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding this step's rows.
        meta: the step's metadata.
        scale: softmax scale.
        plan: :func:`plan_step` of ``meta`` (built here when None); layers of one step share it.
        key, value: optional ``[T, num_kv_heads, head_dim]`` new rows; a prefill chunk that is its sequence's
            whole context then reads them directly instead of gathering them back from the cache.
        workspace: gather buffers to reuse across layers and steps (a fresh one when None).
        prefill_dtype: None, or the dtype a float32 query's prefill rows' q, k and v are rounded to for SDPA
            (bfloat16 on CPU: torch's flash kernel then multiplies on AMX / AVX512-BF16 and accumulates in fp32; the
            output is cast back to float32). Decode rows and other query dtypes are unaffected.
        sliding_window: None, or the keys each query sees counting its own
            (:meth:`~pagedserve.attention.base.AttentionBackend.forward`).
        decodes: False leaves the decode rows of ``out`` unwritten (uninitialized), for a caller that computes
            them itself.
        softcap: None, or Gemma 2's soft-cap of the scaled scores (``c * tanh(s / c)``).
        sinks: None, or ``[num_heads]`` float: gpt-oss's per-head sink logits (:func:`softmax_attention`).

    Returns:
        ``[T, num_heads, head_dim]``, query's dtype. Softmax is computed in fp32 for fp16/bf16 inputs on CUDA; the
        CPU flash kernel accumulates reduced precision inputs in fp32 itself.
    """
    if plan is None:
        plan = plan_step(meta, k_cache.shape[1])
    decode_masks, prefill_masks = plan.window_masks(check_sliding_window(sliding_window) or None)
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    check_softcap_sinks(softcap, sinks, num_heads)
    math = softcap is not None or sinks is not None
    gqa = num_heads != num_kv_heads
    upcast = query.dtype in (torch.float16, torch.bfloat16) and query.device.type != "cpu"
    compute_dtype = torch.float32 if upcast else query.dtype
    head_dim = query.shape[2]
    workspace = workspace or Workspace()
    for g, mask in zip(plan.decode_groups if decodes else (), decode_masks):
        n = g.end - g.start
        # Gather the group's blocks into reused buffers (index_select with out=: no fresh allocation per layer),
        # then view them [n, Hkv, S, D] without a copy.
        k_rows, v_rows = workspace.kv_buffers(g.tables.numel(), k_cache)
        torch.index_select(k_cache, 0, g.tables, out=k_rows)
        torch.index_select(v_cache, 0, g.tables, out=v_rows)
        k = k_rows.view(n, -1, num_kv_heads, head_dim).permute(0, 2, 1, 3)
        v = v_rows.view(n, -1, num_kv_heads, head_dim).permute(0, 2, 1, 3)
        # GQA folded into the query length: the H / Hkv query heads of a KV head are its "query rows"
        # [n, Hkv, H / Hkv, D] (query head h reads KV head h // (H / Hkv)), so no K/V head is repeated.
        q = query[g.start:g.end].reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if math:
            sink = None if sinks is None else sinks.float().view(1, num_kv_heads, -1, 1)
            o = softmax_attention(q, k, v, mask, scale, softcap, sink)
        else:
            o = F.scaled_dot_product_attention(q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype),
                                               attn_mask=mask, scale=scale)
        out[g.start:g.end] = o.reshape(n, num_heads, head_dim).to(out.dtype)
    nd, starts = meta.num_decode_seqs, plan.query_starts
    for i in range(nd, meta.num_seqs):
        q_len, ctx_len = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
        a, b = starts[i], starts[i] + q_len
        first, mask = prefill_masks[i - nd]
        if mask is None and key is not None:
            k, v = key[a:b], value[a:b]
        else:
            k = gather_kv(k_cache, meta.block_tables[i], ctx_len)[first:]
            v = gather_kv(v_cache, meta.block_tables[i], ctx_len)[first:]
        if math:
            out[a:b] = _prefill_math(query[a:b], k, v, mask, scale, softcap, sinks).to(query.dtype)
            continue
        # 4-D inputs: torch's CPU flash kernel takes only those (3-D ones fall back to the unfused math path).
        dtype = prefill_dtype if prefill_dtype is not None and query.dtype == torch.float32 else compute_dtype
        o = F.scaled_dot_product_attention(
            query[a:b].transpose(0, 1)[None].to(dtype), k.transpose(0, 1)[None].to(dtype),
            v.transpose(0, 1)[None].to(dtype), attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=gqa)
        out[a:b] = o[0].transpose(0, 1).to(query.dtype)
    return out


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: :func:`reshape_and_cache` then :func:`paged_attention_ref`. Runs on CPU or GPU."""

    name = "torch"
    #: None, or the dtype float32 prefill rows are rounded to for SDPA (:func:`paged_attention_ref`); only
    #: bench/prefill.py's baseline sets it (bfloat16) now: the cpu backend runs its own float32 kernel.
    prefill_dtype: torch.dtype | None = None

    def __init__(self) -> None:
        self._plan_step: object | None = None                         # the step the plans below are of
        self._plans: list[tuple[AttentionMetadata, StepPlan]] = []    # per metadata of that step (a KV group's)
        self._workspace = Workspace()

    def forward(self, query, key, value, k_cache, v_cache, meta, scale, sliding_window=None, *, softcap=None,
                sinks=None):
        self._write_kv(query, key, value, k_cache, v_cache, meta)
        return paged_attention_ref(query, k_cache, v_cache, meta, scale, self._step_plan(meta, k_cache.shape[1]),
                                   key, value, self._workspace, self.prefill_dtype, sliding_window,
                                   softcap=softcap, sinks=sinks)

    @staticmethod
    def _check_kv(query, key, value, k_cache) -> None:
        """Raises ValueError: query not ``[T, H, D]``, key and value of different shapes or not ``T`` rows, or a
        cache whose dtype is neither the key's nor float16 / bfloat16 (``--kv-cache-dtype``)."""
        if query.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0]:
            raise ValueError(f"bad shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                             f"value {tuple(value.shape)}")
        if k_cache.dtype != key.dtype and k_cache.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"k_cache dtype {k_cache.dtype} != key dtype {key.dtype}")

    def _write_kv(self, query, key, value, k_cache, v_cache, meta) -> None:
        """Check the shapes and dtypes, then write the step's K/V rows into the caches (slot -1 rows skipped)."""
        self._check_kv(query, key, value, k_cache)
        reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def _step_plan(self, meta, block_size: int) -> StepPlan:
        """:func:`plan_step` of ``meta``, built once per step and shared by its layers (once per KV layer group's
        metadata when the step has several: their block tables differ)."""
        step = meta.groups if meta.groups is not None else meta
        if step is not self._plan_step:
            self._plan_step, self._plans = step, []
        for m, plan in self._plans:
            if m is meta:
                return plan
        plan = plan_step(meta, block_size)
        self._plans.append((meta, plan))
        return plan
