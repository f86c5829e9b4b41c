"""GGUF tensors as HF-named tensors: names by architecture (:mod:`.gguf_arch`), llama's Q/K rows put back in HF
(neox) order, Gemma's stored ``w + 1`` norms back to ``w``, 3-D expert tensors split per expert, and with
``keep_quantized`` the Q4_0/Q4_1/Q8_0 linears (experts included) as their blocks (:mod:`.gguf_blocks`).

Sources: gguf-py ``constants.MODEL_TENSORS`` / ``TENSOR_NAMES`` (names), llama.cpp ``convert_hf_to_gguf.py``
(``LlamaModel.permute``; Gemma's ``norm.weight + 1``; Qwen3-MoE's and Mixtral's experts stacked ``[experts, N, K]``),
transformers ``modeling_gguf_pytorch_utils.py`` (``LlamaTensorProcessor``, ``Gemma2TensorProcessor``,
``Qwen2MoeTensorProcessor``: the same inverse transforms).
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from .gguf_arch import GGUF_ARCHITECTURES, GGUFArchitecture, architecture_of_gguf, metadata
from .gguf_rope import CONFIG_TENSORS

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def gguf_to_hf_name(name: str, arch: GGUFArchitecture = GGUF_ARCHITECTURES["llama"]) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (a 3-D expert tensor's name holds
    ``{e}`` for the expert index; the older one-tensor-per-expert ``blk.3.ffn_gate.5.weight`` names its expert).

    Raises:
        ValueError: for a tensor name ``arch`` does not map (the rope tensors of :mod:`.gguf_rope` are read into
            the config, not here).
    """
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    legacy = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight", name)
    if legacy and f"ffn_{legacy.group(2)}_exps" in arch.layer_tensors:   # one 2-D tensor per expert (older files)
        return f"model.layers.{legacy.group(1)}.mlp.experts.{legacy.group(3)}.{legacy.group(2)}_proj.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in arch.layer_tensors:
        raise ValueError(f"GGUF tensor {name!r} is not supported for {arch.hf_architecture} (known: "
                         f"{sorted(arch.layer_tensors)})")
    return f"model.layers.{m.group(1)}.{arch.layer_tensors[m.group(2)]}.{m.group(3)}"


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (it stores each head's rows interleaved for GPT-J-style rotary).

    ``w``: ``[num_heads * head_dim, ...]``; returns the same shape with each head's rows in HF order (the first half of
    a head's rows are the rotary pairs' first elements).
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _check_types(tensors, keep_quantized: bool) -> None:
    """Refuse, before any tensor is read, a tensor type gguf cannot dequantize (and the loader cannot keep)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from .gguf_blocks import KEPT_TYPES

    seen = set()
    for t in tensors:
        kind = t.tensor_type
        if kind.name in _FLOAT_TYPES or (keep_quantized and kind.name in KEPT_TYPES) or kind in seen:
            continue
        block, size = GGML_QUANT_SIZES[kind]
        try:
            dequantize(np.zeros((1, size), dtype=np.uint8), kind)
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {t.name!r} has type {kind.name}, which the engine can neither keep as "
                             f"stored (kept: {sorted(KEPT_TYPES)}) nor dequantize") from None
        seen.add(kind)


def iter_gguf(path: str, config, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
    """``(hf_name, tensor)`` of every tensor of the GGUF file at ``path``: float tensors ``dtype`` in HF layout
    (``[N, K]`` linears, ``[N]`` norms and biases); with ``keep_quantized``, a 2-D Q4_0/Q4_1/Q8_0 weight (each
    expert of a 3-D one) as an :class:`~.quant.Int4Weight` / :class:`~.quant.Int8BlockWeight` (its stored codes and
    scales; a Q4_1 block whose int4 zero is not exact in float32 is dequantized instead).

    Raises:
        ValueError: an unknown architecture, tensor name or tensor type, all before any tensor data is read.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch_name, arch = architecture_of_gguf(metadata(reader))
    skip = CONFIG_TENSORS.get(arch_name, frozenset())   # rope factors: read into the config
    tensors = [t for t in reader.tensors if t.name not in skip]
    named = [(t, gguf_to_hf_name(t.name, arch)) for t in tensors]
    _check_types(tensors, keep_quantized)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for t, name in named:
        shape = [int(x) for x in reversed(t.shape)]
        permute = (heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None) \
            if arch.permute_qk else None
        shift = arch.norm_shift if t.name.endswith("norm.weight") else 0.0
        if "{e}" in name:   # [experts, N, K]: one 2-D weight per expert
            for e in range(shape[0]):
                yield name.format(e=e), _tensor(t.data[e], shape[1:], t.tensor_type, None, 0.0, dtype,
                                                keep_quantized)
        else:
            yield name, _tensor(t.data, shape, t.tensor_type, permute, shift, dtype, keep_quantized)


def _tensor(data, shape: list[int], kind, permute: int | None, shift: float, dtype: torch.dtype,
            keep_quantized: bool):
    from gguf.quants import dequantize

    from .gguf_blocks import KEPT_TYPES, InexactRepackError, gguf_to_quant

    if keep_quantized and kind.name in KEPT_TYPES and len(shape) == 2:
        try:
            weight = gguf_to_quant(data, (shape[0], shape[1]), kind.name)
        except InexactRepackError:
            weight = None   # dequantized below, like any other type
        if weight is not None:
            return weight if permute is None else weight.rows(unpermute_rotary_rows(torch.arange(shape[0]), permute))
    tensor = torch.from_numpy(np.array(dequantize(data, kind), dtype=np.float32)).reshape(shape)
    if permute is not None:
        tensor = unpermute_rotary_rows(tensor, permute)
    if shift:
        tensor = tensor - shift   # float32, as transformers' Gemma2TensorProcessor does
    return tensor.to(dtype)
