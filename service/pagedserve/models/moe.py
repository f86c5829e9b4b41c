"""Sparse mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen3-MoE), on CPU and on CUDA
(routing and the weighted sum on cuda/moe.cu there: :meth:`SparseMoeBlock.route_cuda`).

Routing as HF transformers' ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``: router logits ``x @ gate.T`` in the
model dtype, softmax over all experts in float32, the top ``k``, renormalized to sum 1 where the family does
(``norm_topk_prob``; Mixtral always); or as ``GptOssTopKRouter``: a router bias, the top ``k`` logits, softmax over
those ``k`` (``softmax_topk``), experts with biases and gpt-oss's clamped SwiGLU. Each expert is a SwiGLU MLP with fused gate/up (``nn.Linear`` leaves, so
quantized loading and pagedserve's CPU linear kernels take the experts as they take the dense layers; the router
stays a plain float parameter and is never quantized).

The step's (token, expert) pairs are sorted by expert once and each expert runs one matmul over its tokens (a loop
over the experts, none over tokens); the weighted outputs are summed into their tokens with one ``index_add_`` in
ascending expert order, the order transformers adds them in. Counting the tokens per expert reads one small tensor
on the host, so a model with these layers runs its forward eagerly (no ``torch.compile``, no CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import elementwise_ref as ops
from .config_checks import UnsupportedConfig
from .layers import SINGLE, TPGroup, merged_column_linear, row_linear


@dataclass(frozen=True)
class MoeSpec:
    """Attributes: ``num_experts``; ``top_k`` experts per token; ``intermediate_size`` of each expert;
    ``norm_topk_prob`` (renormalize the top-k probabilities); ``sparse_layers`` (per layer: mixture of experts, or
    a dense MLP of the config's ``intermediate_size``); ``router_bias`` (the router has a bias); ``softmax_topk``
    (the softmax runs over the top-k logits only, gpt-oss, instead of over all experts before the top-k);
    ``expert_bias`` (biases on each expert's gate/up and down); ``swiglu_limit`` / ``swiglu_alpha``: None, or
    gpt-oss's clamped SwiGLU (:func:`clamped_swiglu`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    router_bias: bool = False
    softmax_topk: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


def clamped_swiglu(x: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation (HF transformers' ``GptOssExperts._apply_gate``): ``x`` ``[T, 2 * d]`` holding
    gate then up; ``gate`` clamped to at most ``limit``, ``up`` to ``[-limit, limit]``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``; returns ``[T, d]``."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].clamp(max=limit), x[..., d:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ExpertMLP(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``, gate and up fused (``gate_up_proj``, gate rows first); with
    ``swiglu_limit``, :func:`clamped_swiglu` instead of SiLU-and-mul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float = 1.702, tp: TPGroup = SINGLE):
        super().__init__()
        # under tensor parallelism each rank holds its slice of the intermediate features; the down projection's
        # partial products are summed over the experts and all-reduced once by the block
        self.gate_up_proj = merged_column_linear(hidden, intermediate, 2, bias, tp)
        self.down_proj = row_linear(intermediate, hidden, bias, tp, reduce=False)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha

    def forward(self, x: torch.Tensor, elementwise: ops.ElementwiseOps = ops.TORCH_OPS) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.swiglu_limit is not None:
            return self.down_proj(clamped_swiglu(h, self.swiglu_limit, self.swiglu_alpha))
        return self.down_proj(elementwise.silu_and_mul(h))


class SparseMoeBlock(nn.Module):
    """``[T, hidden] -> [T, hidden]``: the routed sum of ``top_k`` experts per token.

    Parameters: ``gate`` ``[num_experts, hidden]`` (the router; HF ``mlp.gate.weight``), ``experts`` (a
    ``ModuleList`` of :class:`ExpertMLP`; HF ``mlp.experts.{e}.{gate,up,down}_proj``).

    Tensor parallelism slices every expert (vLLM's and Megatron's expert tensor parallelism without expert
    parallelism): each rank holds the router whole and ``intermediate_size / size`` of each expert's gate/up rows
    and down columns; every rank routes alike, runs its slice of the same experts, sums the weighted partial outputs
    and all-reduces that sum once per layer (the down projections' biases on rank 0 only).

    Raises:
        UnsupportedConfig: ``top_k`` outside ``1..num_experts``, or a tensor-parallel size that does not divide
            the experts' intermediate size.
    """

    def __init__(self, hidden: int, spec: MoeSpec, tp: TPGroup = SINGLE):
        super().__init__()
        if spec.intermediate_size % tp.size:
            raise UnsupportedConfig(f"tensor_parallel_size {tp.size} does not divide the experts' intermediate "
                                    f"size {spec.intermediate_size}")
        self.tp = tp
        if not 1 <= spec.top_k <= spec.num_experts:
            raise UnsupportedConfig(f"num_experts_per_tok={spec.top_k}: must be within 1..{spec.num_experts}")
        self.num_experts, self.top_k, self.norm_topk_prob = spec.num_experts, spec.top_k, spec.norm_topk_prob
        self.softmax_topk = spec.softmax_topk
        self.gate = nn.Parameter(torch.zeros(spec.num_experts, hidden))
        if spec.router_bias:
            self.gate_bias = nn.Parameter(torch.zeros(spec.num_experts))
        self.experts = nn.ModuleList(ExpertMLP(hidden, spec.intermediate_size, spec.expert_bias, spec.swiglu_limit,
                                               spec.swiglu_alpha, tp) for _ in range(spec.num_experts))

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, num_experts]`` in x's dtype: ``x @ gate.T`` (+ the router bias)."""
        return F.linear(x, self.gate, getattr(self, "gate_bias", None))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k] in x's dtype, expert ids [T, top_k] int64)`` of each token."""
        logits = self.router_logits(x)
        if self.softmax_topk:   # gpt-oss (HF GptOssTopKRouter): top-k of the logits, softmax over those k
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def route_cuda(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`route` on the router kernel of cuda/moe.cu (:func:`pagedserve.kernels.moe.moe_topk`): the
        logits in float32 (gpt-oss's softmax over the top k too, where :meth:`route` keeps x's dtype)."""
        from ..kernels.moe import moe_topk

        logits = self.router_logits(x).float().contiguous()
        weights, ids = moe_topk(logits, self.top_k, not self.softmax_topk, self.norm_topk_prob)
        return weights.to(x.dtype), ids.long()

    def forward(self, x: torch.Tensor, elementwise: ops.ElementwiseOps = ops.TORCH_OPS) -> torch.Tensor:
        """With the CUDA elementwise set (``elementwise.name == "cuda"``: the CUDA backend, or its host emulator in
        the tests) routing and the weighted sum run on cuda/moe.cu's kernels, else on torch; the experts' matmuls
        are torch's either way."""
        cuda = elementwise.name == "cuda"
        weights, ids = self.route_cuda(x) if cuda else self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)        # (token, slot) pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()   # the forward's one host read
        tokens = order // self.top_k
        xs = x.index_select(0, tokens)
        outs, start = [], 0
        for expert, n in zip(self.experts, counts):
            if n:
                outs.append(expert(xs[start:start + n], elementwise))
            start += n
        ys = torch.cat(outs) * weights.flatten().index_select(0, order)[:, None]
        if cuda:   # each token's rows of ys, in ascending expert order (ys is grouped by expert)
            from ..kernels.moe import moe_combine

            where = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=x.device))
            rows = where.view(-1, self.top_k).sort(dim=-1).values.to(torch.int32).contiguous()
            out = moe_combine(ys.to(x.dtype).contiguous(), rows)
        else:
            out = torch.zeros_like(x).index_add_(0, tokens, ys.to(x.dtype))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


def moe_spec_from(cfg, num_experts_field: str, intermediate_field: str, norm_topk_prob: bool,
                  sparse_layers: tuple[bool, ...] | None = None) -> MoeSpec:
    """A :class:`MoeSpec` read from ``cfg`` (``num_experts_per_tok`` and the named fields); every layer sparse
    unless ``sparse_layers`` says otherwise."""
    n = cfg.num_hidden_layers
    return MoeSpec(num_experts=int(getattr(cfg, num_experts_field)), top_k=int(cfg.num_experts_per_tok),
                   intermediate_size=int(getattr(cfg, intermediate_field)), norm_topk_prob=bool(norm_topk_prob),
                   sparse_layers=sparse_layers if sparse_layers is not None else (True,) * n)

