"""A decode-only step's Llama decoder stack in one C++ call (``torch.ops.pagedserve_cpu.llama_decode_layers``).

At one decode token the step's kernels are short (the int4 linears stream ~80 MB of weights in a few ms) and the
Python around them is not: per layer about a dozen op calls through the dispatcher, twenty tensor views, the
attention backend's checks and slices, ~80 us a layer (bench/profile_step.py, "fused decode" in bench/README.md).
``csrc/decode_stack.cpp`` loops over the layers in C++ calling the very kernels the Python forward calls, with the
same arguments in the same order, so the hidden states are bit for bit the Python forward's
(tests/kernel_tests/test_fused_decode.py checks it), and the op releases the GIL for the whole stack.

It takes a step when every condition of that Python path holds: a model whose layers are all Llama's
(``plain_llama`` of :class:`~.decoder.DecoderForCausalLM`: no q/k norm, multipliers or partial rotary) at tensor
parallel size 1 in float32 whose four linears of every layer are :class:`~.cpu_linear.StreamingInt4Linear` on
their VNNI panels (``use_vnni``), the ``cpu`` attention backend with its kernels, a float32 / float16 / bfloat16 KV
cache, and a step whose rows are all decodes (one token per sequence) of at most the layers' ``vnni_max_tokens``.
Anything else runs the Python forward. :func:`.cpu_linear.use_vnni` (re)builds or drops it (through the model's
``refresh_fused_decode``), so it always follows the layers' VNNI state.
"""
from __future__ import annotations

import torch

from ..attention.base import AttentionMetadata
from ..attention.cpu import CpuAttentionBackend

_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedDecode:
    """The per-model argument lists of ``llama_decode_layers``, built once (:meth:`build`), and the step check.

    Attributes: ``max_tokens`` (the fewest ``vnni_max_tokens`` of the layers), ``num_heads``, ``num_kv_heads``.
    """

    def __init__(self, model, linears: list):
        attn = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.final_norm = attn.num_heads, attn.num_kv_heads, model.norm
        self.scale, self.eps = float(attn.scale), float(model.config.rms_norm_eps)
        self.max_tokens = min(m.vnni_max_tokens for m in linears)
        self.input_norms = [layer.input_layernorm for layer in model.layers]
        self.post_norms = [layer.post_attention_layernorm for layer in model.layers]
        self.packed = [m.vnni_panels[0] for m in linears]
        self.dw = [m.vnni_panels[1] for m in linears]
        self.mw = [m.vnni_panels[2] for m in linears]
        self.biases = [m.bias for m in linears]
        self.out_features = [m.out_features for m in linears]
        self.linears = linears
        self.sliding_windows = [layer.self_attn.sliding_window or 0 for layer in model.layers]

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The fused stack of ``model`` (a :class:`~.llama.LlamaForCausalLM`), or None when it cannot take the
        model's decode steps (see the module docstring: tensor parallel, not float32, a linear off VNNI panels)."""
        if model.tp.size != 1 or model.norm.dtype != torch.float32 or not getattr(model, "plain_llama", False):
            return None
        attn = model.layers[0].self_attn
        if attn.head_dim % 16 or attn.num_heads % attn.num_kv_heads:
            return None
        linears = []
        for layer in model.layers:
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                # a .cpu_linear.StreamingInt4Linear with VNNI panels (by attribute: that module imports this one)
                if getattr(m, "vnni_panels", None) is None or m.vnni_max_tokens < 1:
                    return None
                linears.append(m)
        return cls(model, linears)

    def takes(self, num_tokens: int, meta: AttentionMetadata | None, backend, kv_caches) -> bool:
        """Whether this step runs here: eager metadata, the ``cpu`` backend, every row a decode
        (``num_decode_seqs == num_tokens``), at most ``max_tokens`` of them, a cache type the kernels read, one
        block table for every layer (no KV layer groups). (The kernels are loaded: :meth:`build` found VNNI panels,
        which only they make.)"""
        return (meta is not None and meta.groups is None and 0 < num_tokens <= self.max_tokens
                and meta.num_decode_seqs == num_tokens
                and meta.num_seqs == num_tokens and type(backend) is CpuAttentionBackend
                and kv_caches[0][0].dtype in _CACHE_DTYPES and kv_caches[0][0].device.type == "cpu")

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                 cos_sin: torch.Tensor) -> torch.Tensor:
        """``hidden`` float32 ``[T, hidden]`` (token embeddings), ``positions`` int64 ``[T]``, per layer
        ``(k_cache, v_cache)``; writes the step's K/V rows and returns the final-normed hidden states float32
        ``[T, hidden]`` (what :meth:`~.llama.LlamaForCausalLM.forward` returns)."""
        # the cache lists are built per call (~4 us): holding them would keep an engine's cache alive past it
        return torch.ops.pagedserve_cpu.llama_decode_layers(
            hidden, positions, cos_sin, self.input_norms, self.post_norms, self.final_norm, self.packed, self.dw,
            self.mw, self.biases, self.out_features, [m.a8_levels for m in self.linears], [kv[0] for kv in kv_caches],
            [kv[1] for kv in kv_caches], meta.slot_mapping,
            meta.block_tables, meta.context_lens, self.num_heads, self.num_kv_heads, self.eps, self.scale,
            self.sliding_windows)
