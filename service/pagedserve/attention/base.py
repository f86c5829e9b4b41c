"""The attention backend interface: what the model's attention layers call, whichever backend runs.

A step's tokens are flattened (vLLM style): ``T`` new tokens from ``B`` sequences laid end to end, sequence ``i``
owning rows ``query_start_loc[i]:query_start_loc[i+1]``. Each sequence's new tokens sit at the end of its context:
its first new token has absolute position ``context_lens[i] - query_lens[i]``. A backend first writes the new K/V rows
into the paged cache at ``slot_mapping`` (reshape_and_cache), then computes causal attention of each new token over
the sequence's whole context read through its block table (PagedAttention, Kwon et al., SOSP 2023).

KV cache layout, per layer: ``k_cache`` and ``v_cache`` each ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token ``j`` of a sequence lives in block ``block_tables[i, j // block_size]`` at offset ``j % block_size``, i.e. in
slot ``block * block_size + offset``.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from ..kernels import elementwise_ref as ops


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch description shared by all layers. All tensors live on the model's device.

    Attributes:
        slot_mapping: ``[T]`` int64, the cache slot of each new token; ``-1`` marks padding, which is not written.
        block_tables: ``[B, max_blocks_per_seq]`` int32, physical block ids; entries past a sequence's last block
            are padding (any value, never read).
        context_lens: ``[B]`` int32, tokens in each sequence's context after this step (cached + new).
        query_start_loc: ``[B + 1]`` int32, prefix sums of ``query_lens``; ``query_start_loc[-1] == T``.
        query_lens: ``[B]`` int32, new tokens per sequence this step (1 for a decode).
        max_query_len: host int, ``max(query_lens)``.
        max_context_len: host int, ``max(context_lens)``.
        num_decode_seqs: host int; the first ``num_decode_seqs`` sequences have ``query_len == 1`` (the model
            runner orders decodes first), the rest are prefill chunks.
        query_lens_cpu / context_lens_cpu: the same as host lists, for backends that loop on the host.
        fixed_context_capacity: None for an ordinary step. Set (tokens, >= every context length) by the CUDA
            graph runner (:mod:`pagedserve.worker.cuda_graphs`) on a decode-only step that is being captured
            for replay: the host lists and ``max_context_len`` are then placeholders (the capacity), the device
            tensors are the truth, and a backend must launch with a geometry that depends only on the batch
            size and this capacity (:attr:`AttentionBackend.supports_cuda_graphs`).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: torch.Tensor
    max_query_len: int
    max_context_len: int
    num_decode_seqs: int
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    fixed_context_capacity: int | None = None
    #: With several KV layer groups (:mod:`pagedserve.kv_layout`): each group's metadata (its own
    #: ``block_tables`` and ``slot_mapping``, the rest shared; this object is group 0's) and each layer's group.
    #: None: one block table for every layer.
    groups: list | None = None
    layer_groups: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    def for_layer(self, layer_idx: int) -> "AttentionMetadata":
        """The metadata layer ``layer_idx`` attends with: its group's (this object with one group)."""
        return self if self.groups is None else self.groups[self.layer_groups[layer_idx]]


class AttentionBackend(abc.ABC):
    """Computes paged attention for one layer. Stateless apart from compiled kernels; one instance serves all layers.

    Subclasses: :class:`pagedserve.attention.torch_ref.TorchAttentionBackend` (reference, any device) and
    :class:`pagedserve.attention.cuda.CudaAttentionBackend` (CuPy RawModule kernels, CUDA only).
    """

    name: str = "abstract"
    #: Whether :meth:`forward` can be captured in a CUDA graph for decode-only steps: with
    #: ``meta.fixed_context_capacity`` set it reads no host-side per-step value and synchronizes nothing.
    supports_cuda_graphs: bool = False
    #: What :meth:`forward` runs beyond plain causal attention: ``"sliding_window"``, ``"softcap"``, ``"sinks"``.
    #: A model asking for one its backend lacks is refused when the engine is built (:func:`check_features`).
    features: frozenset = frozenset({"sliding_window", "softcap", "sinks"})
    #: The model's elementwise layers (RMSNorm, rotary embedding, SiLU-and-mul) that run with this backend.
    elementwise: ops.ElementwiseOps = ops.TORCH_OPS

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``key``/``value`` into the cache at ``meta.slot_mapping``, then attend.

        Args:
            query: ``[T, num_heads, head_dim]``, the step's new tokens (rotary already applied).
            key, value: ``[T, num_kv_heads, head_dim]``, same dtype as query.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
            meta: the step's :class:`AttentionMetadata`.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            sliding_window: None (every key of the context), or ``W >= 1``: the query at absolute position ``p``
                sees the keys at positions ``p - W + 1 .. p`` only (Mistral's sliding-window attention, Jiang et al.
                2023; transformers' ``sliding_window`` semantics). The cache still holds the whole context.
            softcap: None, or ``c > 0``: each scaled score ``s`` becomes ``c * tanh(s / c)`` before the softmax
                (Gemma 2's ``attn_logit_softcapping``).
            sinks: None, or ``[num_heads]`` float32: one more logit per head in the softmax's denominator, with no
                value row (gpt-oss's attention sinks; :func:`~pagedserve.attention.torch_ref.softmax_attention`).

        Returns:
            ``[T, num_heads, head_dim]``, same dtype as query. GQA: query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``.

        Raises:
            ValueError: on a dtype, shape or device mismatch, a ``sliding_window`` below 1, a ``softcap`` not
                above 0 or ``sinks`` not ``[num_heads]``.
            NotImplementedError: a backend that does not run ``softcap`` / ``sinks`` (the CUDA kernels, today);
                the engine's build refuses such a pairing first (:func:`check_features`).
        """

    def kernel_name(self) -> str:
        """What runs the attention, for the engine's info: "batch-invariant ..." where a row's output is a fixed
        function of its query and the keys and values it sees (the CPU kernel), else the backend's name."""
        return self.name

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    block_copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of KV blocks (PagedAttention's beam search): for each ``(src, dst)`` block id pair, block
        ``src`` of every layer's K and V cache (``[num_blocks, block_size, num_kv_heads, head_dim]``) is copied
        into block ``dst``. Destinations are distinct and never a source of the same call. This reference version
        is one index copy per cache; backends with kernels override it."""
        if not block_copies:
            return
        device = kv_caches[0][0].device
        src = torch.tensor([s for s, _ in block_copies], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in block_copies], dtype=torch.int64, device=device)
        for k_cache, v_cache in kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))



def check_features(backend: AttentionBackend, needs: dict[str, str]) -> None:
    """Refuse a model whose attention needs what ``backend`` does not run.

    Args:
        needs: feature (``"softcap"``, ``"sinks"``, ``"sliding_window"``) -> the config field asking for it, as
            ``"attn_logit_softcapping=50.0"`` (the model's ``attention_features()``).

    Raises:
        ValueError: naming the config field and the backend (``--attention-backend torch`` or ``cpu`` runs every
            feature).
    """
    for feature, field in needs.items():
        if feature not in backend.features:
            raise ValueError(f"{field}: the {backend.name!r} attention backend does not run {feature} "
                             f"(use --attention-backend torch or cpu)")
