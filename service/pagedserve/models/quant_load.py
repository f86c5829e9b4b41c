"""Which quantized layer each weight becomes (``--quantization``), and the load-time plumbing that builds them.

Before the weights are read, :func:`prepare_model` swaps the model's linears (and its embedding) for
:class:`PendingLinear` / :class:`PendingEmbedding` placeholders while the model is still on the meta device, so no
float copy of a quantized weight is ever allocated. The loader hands each placeholder its pieces (the fused QKV and
gate/up shards, possibly still GGUF blocks); :func:`finalize` then builds the real layer per :class:`QuantPlan`:

=========  =====================================  =========================================  =====================
scheme     GGUF Q4_0 / Q4_1                        GGUF Q8_0                                   other weights
=========  =====================================  =========================================  =====================
``gguf``   int4, as stored (group 32)              int8 per channel (requantized)             dense, ``dtype``
``int4``   int4, as stored                         int4 per group (requantized)               int4 per group
``int8``   int8 per channel (requantized)          int8 per channel (requantized)             int8 per channel
=========  =====================================  =========================================  =====================

With pagedserve's CPU kernels (``plan.cpu_kernels``, :mod:`.cpu_linear`), Q8_0 weights are kept as stored under
``gguf`` and ``int8`` (the tied LM head runs on the embedding's own Q8_0 codes, exactly); on torch's kernels they
are requantized per channel and the LM head's top logits rescored (:class:`~.quant.RescoredLMHead`).

``gguf`` is ``auto`` on a GGUF file; ``auto`` on an HF checkpoint is ``none`` (no placeholders at all). The LM head
is int8 per channel unless its weight is stored int4 (it is tied to the Q8_0 embedding in the embedded model); a
Q8_0 embedding stays Q8_0 (:class:`~.quant.Q8Embedding`). Fused pieces that are not all int4 blocks of one group
size are dequantized first.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import structlog
import torch
from torch import nn

from .cpu_linear import StreamingInt4Linear, StreamingInt8Linear
from .quant import (Int4Linear, Int4Weight, Int8BlockWeight, Int8Linear, Q8Embedding, RescoredLMHead,
                    quantize_int4, quantize_int8_per_channel)

log = structlog.get_logger(__name__)

SCHEMES = ("none", "int8", "int4", "auto")


def resolve_scheme(requested: str, is_gguf: bool, device: torch.device) -> str:
    """The scheme to run: "none", "int8", "int4" or "gguf" (each GGUF tensor keeps its own where a kernel exists).

    The kernels used are CPU ones; on other devices every scheme becomes "none" (dequantized to the model dtype),
    with a log line. Raises ValueError for an unknown ``requested``.
    """
    if requested not in SCHEMES:
        raise ValueError(f"quantization: unknown scheme {requested!r}; one of {SCHEMES}")
    scheme = ("gguf" if is_gguf else "none") if requested == "auto" else requested
    if scheme != "none" and device.type != "cpu":
        log.info("quantization: no weight-only kernel wired for this device; dequantizing", requested=requested,
                 device=str(device))
        return "none"
    return scheme


@dataclass
class QuantPlan:
    """How to build quantized layers. ``counts`` tallies what was built, for the log line and GetModelInfo."""

    scheme: str                 # "int8", "int4" or "gguf" (see resolve_scheme)
    group_size: int             # int4 group size for weights quantized at load
    dtype: torch.dtype          # the compute dtype (dense fallbacks and embeddings)
    cpu_kernels: bool = False   # build the layers of .cpu_linear (pagedserve's CPU kernels) instead of torch's
    counts: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        """e.g. ``"gguf: 210 linear int4-g32 (Q4_1 as stored), lm_head int8 (per channel), embedding Q8_0"``."""
        return f"{self.scheme}: " + ", ".join(f"{n} {k}" if n > 1 else k for k, n in sorted(self.counts.items()))


class PendingLinear(nn.Module):
    """Placeholder of a linear awaiting its (possibly quantized) weight pieces; holds the bias if any."""

    def __init__(self, linear: nn.Linear, num_shards: int):
        super().__init__()
        self.in_features, self.out_features, self.num_shards = linear.in_features, linear.out_features, num_shards
        self.bias = linear.bias
        self.pieces: dict[int, object] = {}

    def add(self, shard: int | None, weight) -> None:
        self.pieces[shard or 0] = weight


class PendingEmbedding(nn.Module):
    """Placeholder of the token embedding awaiting its weight."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.pieces: dict[int, object] = {}

    def add(self, shard: int | None, weight) -> None:
        self.pieces[0] = weight


def prepare_model(model: nn.Module, shards_of) -> None:
    """Swap every ``nn.Linear`` and ``nn.Embedding`` of a meta-device model for placeholders.

    shards_of: ``f(param_name) -> list`` of the shard indices a fused parameter is loaded from.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            new = PendingLinear(module, len(shards_of(f"{name}.weight")))
        elif isinstance(module, nn.Embedding):
            new = PendingEmbedding(module)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)


def _dense(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize()


def _int4_layer(w: Int4Weight, bias, plan: QuantPlan) -> nn.Module | None:
    if plan.cpu_kernels and w.group_size % 32 == 0 and w.codes.shape[1] % w.group_size == 0:
        return StreamingInt4Linear(w, bias)
    if w.codes.shape[0] % 16 == 0 and not plan.cpu_kernels:
        return Int4Linear(w, bias)
    return None


def build_linear(pieces: list, bias: torch.Tensor | None, plan: QuantPlan, lm_head: bool) -> nn.Module:
    """The layer for a linear whose weight is the concatenation (along N) of ``pieces``."""
    kind = "lm_head" if lm_head else "linear"
    int4 = all(isinstance(p, Int4Weight) for p in pieces) and len({p.group_size for p in pieces}) == 1
    if int4 and plan.scheme in ("gguf", "int4"):
        w = Int4Weight.cat(pieces)
        if (layer := _int4_layer(w, bias, plan)) is not None:
            plan.counts[f"{kind} int4-g{w.group_size} ({w.source} as stored)"] += 1
            return layer
    all_q8 = all(isinstance(p, Int8BlockWeight) for p in pieces)
    if all_q8 and plan.cpu_kernels and plan.scheme in ("gguf", "int8"):
        plan.counts[f"{kind} Q8_0 (as stored)"] += 1
        w = pieces[0] if len(pieces) == 1 else Int8BlockWeight(torch.cat([p.codes for p in pieces]),
                                                               torch.cat([p.scales for p in pieces]))
        return StreamingInt8Linear(w, bias, source="Q8_0")   # a tied head shares the embedding's codes
    dense = torch.cat([_dense(p) for p in pieces])
    if plan.scheme == "int4" and not lm_head and dense.shape[1] % plan.group_size == 0 and \
            (layer := _int4_layer(quantize_int4(dense, plan.group_size), bias, plan)) is not None:
        plan.counts[f"linear int4-g{plan.group_size} (quantized at load)"] += 1
        return layer
    if plan.scheme in ("int4", "int8") or lm_head or all_q8:
        how = "requantized from Q8_0" if all_q8 else "quantized at load"
        q8 = quantize_int8_per_channel(dense)
        int8_layer = StreamingInt8Linear if plan.cpu_kernels else Int8Linear
        if lm_head:
            head = RescoredLMHead(int8_layer(q8, bias, source=how), pieces[0] if all_q8 else q8)
            plan.counts[f"lm_head int8 per channel ({how}; top-{head.top_k} logits exact)"] += 1
            return head
        plan.counts[f"linear int8 per channel ({how})"] += 1
        return int8_layer(q8, bias, source=how)
    plan.counts[f"linear dense {str(plan.dtype).removeprefix('torch.')} (dequantized)"] += 1
    layer = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None, dtype=plan.dtype)
    layer.weight.data.copy_(dense)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


def build_embedding(weight, plan: QuantPlan) -> nn.Module:
    if isinstance(weight, Int8BlockWeight):
        plan.counts["embedding Q8_0 (as stored)"] += 1
        return Q8Embedding(weight, plan.dtype)
    emb = nn.Embedding(*weight.shape if isinstance(weight, torch.Tensor) else weight.codes.shape, dtype=plan.dtype)
    emb.weight.data.copy_(_dense(weight))
    return emb


def finalize(model: nn.Module, plan: QuantPlan, tied_lm_head: bool) -> None:
    """Replace the placeholders with built layers (see the module docstring). With ``tied_lm_head``, the model's
    ``lm_head`` is set to an LM head built from the embedding's weight (int8 per channel unless stored int4); under
    tensor parallelism (an ``lm_head`` with a ``linear`` child, :class:`~.layers.ParallelLMHead`) that child is,
    from this rank's embedding rows.

    Raises:
        ValueError: a placeholder missing some of its pieces.
    """
    embed_weight = None
    for name, module in list(model.named_modules()):
        if not isinstance(module, (PendingLinear, PendingEmbedding)):
            continue
        expected = module.num_shards if isinstance(module, PendingLinear) else 1
        if tied_lm_head and name == "lm_head.linear" and not module.pieces:
            continue   # built from the embedding below
        if len(module.pieces) != expected:
            raise ValueError(f"weights missing from the checkpoint: {name}.weight")
        pieces = [module.pieces[i] for i in sorted(module.pieces)]
        if isinstance(module, PendingEmbedding):
            embed_weight = pieces[0]
            new = build_embedding(embed_weight, plan)
        else:
            bias = None if module.bias is None else module.bias.data
            new = build_linear(pieces, bias, plan, lm_head=name.endswith("lm_head"))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    if tied_lm_head and embed_weight is not None:
        head = build_linear([embed_weight], None, plan, lm_head=True)
        if hasattr(model.lm_head, "linear"):
            model.lm_head.linear = head
        else:
            model.lm_head = head
    log.info("quantization", summary=plan.summary())
