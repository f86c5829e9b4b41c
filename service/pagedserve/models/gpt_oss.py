"""gpt-oss (HF transformers' ``GptOssForCausalLM``; OpenAI 2025): Llama's pre-norm decoder with biases on Q/K/V and
the output projection, one learned attention-sink logit per head (``self_attn.sinks``: joins each softmax's
denominator, :func:`~pagedserve.attention.torch_ref.softmax_attention`), sliding-window layers by ``layer_types``
(alternating with full attention in the released models), ``yarn`` rotary, and a mixture of
``num_local_experts`` experts on every layer: a router with a bias, softmax over the top ``num_experts_per_tok``
logits, experts with biases and the clamped SwiGLU of ``swiglu_limit`` / ``swiglu_alpha`` (:mod:`.moe`).

The checkpoint stores each layer's experts as three stacked tensors, ``mlp.experts.gate_up_proj`` ``[E, hidden,
2 * I]`` (gate and up columns interleaved: gate at even columns), ``mlp.experts.down_proj`` ``[E, I, hidden]`` and
their biases; they are read as one ``nn.Linear`` pair per expert (weights transposed, gate rows then up rows) so
quantized loading and the CPU linear kernels take them as the other families' experts. Refused at start-up:
a ``quantization_config`` (the released checkpoints' MXFP4 experts are not read yet).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from .config_checks import UnsupportedConfig
from .decoder import DecoderForCausalLM, DecoderSpec
from .moe import moe_spec_from


class GptOssForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        qc = getattr(cfg, "quantization_config", None)
        if qc:
            method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", qc)
            raise UnsupportedConfig(f"quantization_config.quant_method={method!r}: quantized gpt-oss checkpoints "
                                    f"(MXFP4 experts) are not read; give a bfloat16 checkpoint")
        moe = moe_spec_from(cfg, "num_local_experts", "intermediate_size", False)
        moe = replace(moe, router_bias=True, softmax_topk=True, expert_bias=True,
                      swiglu_limit=float(cfg.swiglu_limit), swiglu_alpha=float(cfg.swiglu_alpha))
        bias = bool(getattr(cfg, "attention_bias", True))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, moe=moe, attention_sinks=True)

    def hf_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        for name, tensor in weights:
            if ".mlp.router." in name:
                yield name.replace(".mlp.router.weight", ".mlp.gate.weight").replace(".mlp.router.bias",
                                                                                     ".mlp.gate_bias"), tensor
            elif ".mlp.experts." in name:
                yield from _split_experts(name, tensor)
            else:
                yield name, tensor


def _split_experts(name: str, tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor as per-expert Llama-named ones (``mlp.experts.{e}.gate_proj.weight`` ...)."""
    if not isinstance(tensor, torch.Tensor):
        tensor = tensor.dequantize()
    prefix, kind = name.split(".mlp.experts.")
    base = f"{prefix}.mlp.experts"
    for e in range(tensor.shape[0]):
        t = tensor[e]
        if kind == "gate_up_proj":        # [hidden, 2I], gate at even columns
            yield f"{base}.{e}.gate_proj.weight", t[:, 0::2].T
            yield f"{base}.{e}.up_proj.weight", t[:, 1::2].T
        elif kind == "gate_up_proj_bias":
            yield f"{base}.{e}.gate_proj.bias", t[0::2]
            yield f"{base}.{e}.up_proj.bias", t[1::2]
        elif kind == "down_proj":         # [I, hidden]
            yield f"{base}.{e}.down_proj.weight", t.T
        elif kind == "down_proj_bias":
            yield f"{base}.{e}.down_proj.bias", t
        else:
            raise ValueError(f"unexpected weight {name!r}")
