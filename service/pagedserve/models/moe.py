"""Sparse mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen3-MoE), on CPU.

Routing as HF transformers' ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``: router logits ``x @ gate.T`` in the
model dtype, softmax over all experts in float32, the top ``k``, renormalized to sum 1 where the family does
(``norm_topk_prob``; Mixtral always). Each expert is a SwiGLU MLP with fused gate/up (``nn.Linear`` leaves, so
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
from .layers import SINGLE, TPGroup


@dataclass(frozen=True)
class MoeSpec:
    """Attributes: ``num_experts``; ``top_k`` experts per token; ``intermediate_size`` of each expert;
    ``norm_topk_prob`` (renormalize the top-k probabilities); ``sparse_layers`` (per layer: mixture of experts, or
    a dense MLP of the config's ``intermediate_size``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]


class ExpertMLP(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``, gate and up fused (``gate_up_proj``, gate rows first)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, elementwise: ops.ElementwiseOps = ops.TORCH_OPS) -> torch.Tensor:
        return self.down_proj(elementwise.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """``[T, hidden] -> [T, hidden]``: the routed sum of ``top_k`` experts per token.

    Parameters: ``gate`` ``[num_experts, hidden]`` (the router; HF ``mlp.gate.weight``), ``experts`` (a
    ``ModuleList`` of :class:`ExpertMLP`; HF ``mlp.experts.{e}.{gate,up,down}_proj``).

    Raises:
        UnsupportedConfig: at tensor-parallel size > 1 (experts are not sliced yet), or ``top_k`` outside
            ``1..num_experts``.
    """

    def __init__(self, hidden: int, spec: MoeSpec, tp: TPGroup = SINGLE):
        super().__init__()
        if tp.size > 1:
            raise UnsupportedConfig("tensor_parallel_size: mixture-of-experts layers run at tensor-parallel size 1 "
                                    "only")
        if not 1 <= spec.top_k <= spec.num_experts:
            raise UnsupportedConfig(f"num_experts_per_tok={spec.top_k}: must be within 1..{spec.num_experts}")
        self.num_experts, self.top_k, self.norm_topk_prob = spec.num_experts, spec.top_k, spec.norm_topk_prob
        self.gate = nn.Parameter(torch.zeros(spec.num_experts, hidden))
        self.experts = nn.ModuleList(ExpertMLP(hidden, spec.intermediate_size) for _ in range(spec.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k] in x's dtype, expert ids [T, top_k] int64)`` of each token."""
        probs = torch.softmax(F.linear(x, self.gate), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, elementwise: ops.ElementwiseOps = ops.TORCH_OPS) -> torch.Tensor:
        weights, ids = self.route(x)
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
        return torch.zeros_like(x).index_add_(0, tokens, ys.to(x.dtype))


def moe_spec_from(cfg, num_experts_field: str, intermediate_field: str, norm_topk_prob: bool,
                  sparse_layers: tuple[bool, ...] | None = None) -> MoeSpec:
    """A :class:`MoeSpec` read from ``cfg`` (``num_experts_per_tok`` and the named fields); every layer sparse
    unless ``sparse_layers`` says otherwise."""
    n = cfg.num_hidden_layers
    return MoeSpec(num_experts=int(getattr(cfg, num_experts_field)), top_k=int(cfg.num_experts_per_tok),
                   intermediate_size=int(getattr(cfg, intermediate_field)), norm_topk_prob=bool(norm_topk_prob),
                   sparse_layers=sparse_layers if sparse_layers is not None else (True,) * n)

