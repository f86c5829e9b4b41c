"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, "Megatron-LM"; the layout vLLM uses).

Each layer keeps its rank's shard of the matmul in a child module (``.linear``, a plain ``nn.Linear`` or, after
quantized loading, a layer of :mod:`.quant`; ``.embedding`` an ``nn.Embedding``) and does the collective around it,
so code that swaps leaf linears for other kernels never needs to know about parallelism.

- :class:`ColumnParallelLinear`: output features split; a fused weight (Q/K/V, gate/up) is split piece by piece, so
  each rank's local weight is ``[q_r | k_r | v_r]`` (or ``[gate_r | up_r]``). No collective: outputs stay sharded.
- :class:`RowParallelLinear`: input features split; partial products all-reduced (sum). Bias on rank 0 only.
- :class:`VocabParallelEmbedding`: vocabulary rows split (padded to a multiple of the size); ids outside a rank's
  range give zero rows; all-reduced.
- :class:`ParallelLMHead`: vocabulary rows split; logits gathered to rank 0 (other ranks get None).

Weight loading: :meth:`take` cuts a rank's part out of a full checkpoint tensor as it is read.
At size 1 the model builds plain layers (:func:`column_linear` and friends), so nothing changes there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group.

    rank: 0..size-1. size: ranks. group: the torch.distributed process group (None: the default group).
    """

    rank: int = 0
    size: int = 1
    group: object = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (a no-op at size 1); returns ``t``."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def gather_rows_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``[N, n]`` along the last dim on rank 0 (``[N, size * n]``); None elsewhere."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


SINGLE = TPGroup()


def split_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(local query heads, local KV heads, first KV head of this rank)``.

    Query heads must divide by the size. KV heads either divide too, or (fewer KV heads than ranks, the size a
    multiple of them) are replicated: rank ``r`` holds KV head ``r * num_kv_heads // size``, which its query heads
    use in the unsplit model (GQA groups are contiguous).

    Raises:
        ValueError: naming the head counts and the size when they cannot be split.
    """
    n = tp.size
    if num_heads % n or not (num_kv_heads % n == 0 or n % num_kv_heads == 0):
        raise ValueError(f"tensor_parallel_size {n} does not split the model's {num_heads} query heads and "
                         f"{num_kv_heads} KV heads: the query heads must divide by it, and the KV heads divide by "
                         f"it or it by them (replicated KV heads)")
    if num_kv_heads >= n:
        local_kv = num_kv_heads // n
        return num_heads // n, local_kv, tp.rank * local_kv
    return num_heads // n, 1, tp.rank * num_kv_heads // n


def _check_divides(total: int, tp: TPGroup, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} does not divide {what} {total}")
    return total // tp.size


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ W_r^T (+ b_r)`` with ``W_r`` this rank's rows of each fused piece. x: ``[T, in]``; y_r:
    ``[T, sum(local sizes)]``, the model dtype.

    pieces: per fused piece ``(first row in the full piece, local rows)``; the full piece ``i`` is what the
    checkpoint's tensor for shard ``i`` holds.
    """

    def __init__(self, in_features: int, pieces: list[tuple[int, int]], bias: bool, tp: TPGroup):
        super().__init__()
        self.tp, self.pieces = tp, pieces
        self.linear = nn.Linear(in_features, sum(n for _, n in pieces), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def take(self, full, shard: int | None, kind: str):
        """This rank's rows of the checkpoint tensor for piece ``shard`` (a tensor or a quantized weight with
        ``rows``); ``kind`` ("weight"/"bias") is unused: both split by rows."""
        start, n = self.pieces[shard or 0]
        index = torch.arange(start, start + n)
        return full[start:start + n] if isinstance(full, torch.Tensor) else full.rows(index)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r @ W_r^T + b``: x_r ``[T, in / size]`` (this rank's input columns, as a column-parallel layer
    left them); the partial products are all-reduced, so y ``[T, out]`` is the same on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.local_in = _check_divides(in_features, tp, "the input features")
        self.linear = nn.Linear(self.local_in, out_features, bias=bias and tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``reduce=False`` returns this rank's partial product (an expert's: the mixture sums the experts' partial
        outputs and all-reduces once, :class:`~.moe.SparseMoeBlock`)."""
        y = self.linear(x)
        return self.tp.all_reduce(y) if self.reduce else y

    def take(self, full, shard: int | None, kind: str):
        """This rank's input columns of the weight; the bias on rank 0 (None elsewhere: it is added once)."""
        if kind == "bias":
            return full if self.tp.rank == 0 else None
        start = self.tp.rank * self.local_in
        if isinstance(full, torch.Tensor):
            return full[:, start:start + self.local_in]
        return full.cols(start, start + self.local_in)


def _vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    local = -(-vocab_size // tp.size)
    return tp.rank * local, local


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds vocabulary rows ``[r * V_l, (r + 1) * V_l)`` (``V_l = ceil(V / size)``; rows past V are
    zero). ids: ``[T]`` int64 -> ``[T, hidden]``, the same on every rank after the all-reduce."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, self.local_vocab = _vocab_range(vocab_size, tp)
        self.embedding = nn.Embedding(self.local_vocab, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = self.embedding(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def take(self, full, shard: int | None, kind: str):
        """This rank's vocabulary rows (fewer than ``local_vocab`` on the last rank when V does not divide)."""
        end = min(self.start + self.local_vocab, self.vocab_size)
        if isinstance(full, torch.Tensor):
            return full[self.start:end]
        return full.rows(torch.arange(self.start, end))


class ParallelLMHead(nn.Module):
    """``logits = hidden @ E^T`` by vocabulary shards, gathered to rank 0. hidden ``[N, hidden]`` -> float32
    ``[N, V]`` on rank 0, None on the others. ``tied``: share the embedding's local rows (tie_word_embeddings)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, self.local_vocab = _vocab_range(vocab_size, tp)
        self.linear = nn.Linear(hidden, self.local_vocab, bias=False)
        if tied is not None:
            self.linear.weight = tied.embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_rows_last_dim(self.linear(hidden).float())
        return None if logits is None else logits[:, :self.vocab_size]

    take = VocabParallelEmbedding.take


def qkv_linear(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TPGroup):
    """The fused Q/K/V projection: ``nn.Linear`` at size 1, else this rank's heads of each of Q, K, V."""
    if tp.size == 1:
        return nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
    local_q, local_kv, kv_start = split_heads(num_heads, num_kv_heads, tp)
    kv = (kv_start * head_dim, local_kv * head_dim)
    return ColumnParallelLinear(hidden, [(tp.rank * local_q * head_dim, local_q * head_dim), kv, kv], bias, tp)


def merged_column_linear(in_features: int, out_features: int, num_pieces: int, bias: bool, tp: TPGroup):
    """``num_pieces`` fused projections of ``out_features`` each (gate/up): ``nn.Linear`` at size 1."""
    if tp.size == 1:
        return nn.Linear(in_features, num_pieces * out_features, bias=bias)
    local = _check_divides(out_features, tp, "the projection size")
    return ColumnParallelLinear(in_features, [(tp.rank * local, local)] * num_pieces, bias, tp)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup, reduce: bool = True):
    """``nn.Linear`` at size 1, else :class:`RowParallelLinear` (``reduce=False``: no all-reduce of its own)."""
    return nn.Linear(in_features, out_features, bias=bias) if tp.size == 1 else \
        RowParallelLinear(in_features, out_features, bias, tp, reduce)


def vocab_embedding(vocab_size: int, hidden: int, tp: TPGroup):
    """``nn.Embedding`` at size 1, else :class:`VocabParallelEmbedding`."""
    return nn.Embedding(vocab_size, hidden) if tp.size == 1 else VocabParallelEmbedding(vocab_size, hidden, tp)


PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)


def take_for_rank(modules: dict[str, nn.Module], target: str, shard: int | None, tensor):
    """Route a checkpoint tensor meant for parameter ``target`` (``<owner>.weight``/``.bias``) of a parallel layer
    to its child: ``(child parameter name, this rank's part, vocab-padded)``, or ``(target, tensor, False)`` for
    any other parameter. The part is None when this rank holds nothing of it (a row-parallel bias off rank 0).
    ``vocab-padded``: the part may have fewer rows than the parameter (the rest are zero padding)."""
    owner, _, kind = target.rpartition(".")
    layer = modules.get(owner)
    if not isinstance(layer, PARALLEL_LAYERS):
        return target, tensor, False
    child = "embedding" if isinstance(layer, VocabParallelEmbedding) else "linear"
    padded = isinstance(layer, (VocabParallelEmbedding, ParallelLMHead))
    return f"{owner}.{child}.{kind}", layer.take(tensor, shard, kind), padded
