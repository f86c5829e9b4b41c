"""Mixtral (HF transformers' ``MixtralForCausalLM``): Mistral's attention and a sparse mixture of
``num_local_experts`` SwiGLU experts on every layer, ``num_experts_per_tok`` per token, the top-k renormalized
(:mod:`.moe`). Checkpoint names ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.{e}.w1|w3|w2`` are read as
``mlp.gate`` / ``mlp.experts.{e}.gate_proj|up_proj|down_proj``."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from .decoder import DecoderForCausalLM, DecoderSpec
from .moe import moe_spec_from

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_NAMES = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


class MixtralForCausalLM(DecoderForCausalLM):
    sliding_window_attention = True

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(moe=moe_spec_from(cfg, "num_local_experts", "intermediate_size", True))

    def hf_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        for name, tensor in weights:
            name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_NAMES[m.group(2)]}.", name)
            yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
