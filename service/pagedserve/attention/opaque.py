"""Attention and the KV write as one ``torch.library`` custom op, so ``torch.compile`` traces the model around it.

Dynamo cannot trace the attention backends (host loops over sequences, per-step plans, CuPy kernels) and must not
specialize on a step's metadata, so the compiled forward calls ``torch.ops.pagedserve.paged_attention(query, key,
value, layer_idx, scale, sliding_window, softcap, sinks)`` instead: an opaque node whose only graph inputs are the layer's Q/K/V. The step's
metadata, the KV caches and the backend are taken from the :func:`step_context` the model runner enters around the
call (vLLM's "forward context" does the same for its unified attention op).

The op writes the new K/V rows into the layer's cache (rows with slot ``-1``, the padding, are skipped), attends
with the backend, and returns a fresh tensor whose padded rows (past ``meta.query_start_loc[-1]``) are zero. It is
registered with ``mutates_args=()``: the caches are not graph values, and the op's output is always used, so the
compiler neither drops nor reorders it against the layers around it.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from .base import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class StepContext:
    """What the attention op of every layer reads during one compiled forward."""

    backend: AttentionBackend                               # the real attention backend
    meta: AttentionMetadata                                 # the step's metadata; slot_mapping padded with -1
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]      # per layer (k_cache, v_cache)
    num_tokens: int                                         # real (unpadded) tokens of the step


_local = threading.local()


@contextlib.contextmanager
def step_context(backend: AttentionBackend, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_tokens: int):
    """Make ``(backend, meta, kv_caches)`` the current step's for :func:`paged_attention` in this thread."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = StepContext(backend, meta, kv_caches, num_tokens)
    try:
        yield _local.ctx
    finally:
        _local.ctx = previous


def current_step() -> StepContext:
    """The context entered by :func:`step_context`. Raises RuntimeError outside one."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("pagedserve::paged_attention called outside a step_context")
    return ctx


@torch.library.custom_op("pagedserve::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                    scale: float, sliding_window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``key``/``value`` into layer ``layer_idx``'s paged cache and attend (see
    :meth:`~pagedserve.attention.base.AttentionBackend.forward`), with the current :func:`step_context`.

    Args:
        query: ``[T_pad, num_heads, head_dim]``; rows past the context's ``num_tokens`` are padding.
        key, value: ``[T_pad, num_kv_heads, head_dim]``; padded rows carry slot ``-1`` and are not written.
        layer_idx: index into the context's ``kv_caches``.
        scale: softmax scale.
        sliding_window: the layer's window in tokens, 0 for full attention.
        softcap: the layer's score soft-cap, 0 for none. sinks: None, or its ``[num_heads]`` sink logits.

    Returns:
        ``[T_pad, num_heads, head_dim]``, query's dtype; padded rows are zero.

    Raises:
        RuntimeError: outside a step context.
    """
    ctx = current_step()
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    out = ctx.backend.forward(query, key, value, k_cache, v_cache, ctx.meta.for_layer(layer_idx), scale, sliding_window or None,
                              softcap=softcap or None, sinks=sinks)
    if ctx.num_tokens < out.shape[0]:
        out[ctx.num_tokens:].zero_()
    return out


@paged_attention.register_fake
def _paged_attention_fake(query, key, value, layer_idx, scale, sliding_window=0, softcap=0.0, sinks=None):
    return torch.empty_like(query)
