"""Sequence-classification heads on the BERT-family encoder (:mod:`.bert`): what HF
``BertForSequenceClassification``, ``RobertaForSequenceClassification`` and ``XLMRobertaForSequenceClassification``
(``CamembertForSequenceClassification`` too) return as ``logits``, the forward of a cross-encoder reranker.

Both heads are the same math on the first token's hidden state (``[CLS]`` / ``<s>``): ``out_proj(tanh(dense(h)))``
(dropout is off at inference). BERT calls ``dense`` its pooler (``bert.pooler.dense``) and ``out_proj`` its
``classifier``; the RoBERTa family keeps both in ``classifier`` (``classifier.dense``, ``classifier.out_proj``).
The encoder's weights load through :func:`.bert.load_bert` (which skips the head's), the head's here.

``ModernBertForSequenceClassification`` runs on its own encoder (:mod:`.modernbert`); :func:`load_sequence_classifier`
dispatches on ``config.json``'s ``architectures``.
"""
from __future__ import annotations

import json
import os
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from .bert import BertEncoder, PackedBatch, load_bert, safetensors_files

# architecture -> (HF prefix of the dense layer, HF prefix of the output projection).
_HEAD_WEIGHTS = {
    "BertForSequenceClassification": ("bert.pooler.dense", "classifier"),
    "RobertaForSequenceClassification": ("classifier.dense", "classifier.out_proj"),
    "XLMRobertaForSequenceClassification": ("classifier.dense", "classifier.out_proj"),
    "CamembertForSequenceClassification": ("classifier.dense", "classifier.out_proj"),
}
MODERNBERT = "ModernBertForSequenceClassification"
SEQUENCE_CLASSIFIERS = tuple(_HEAD_WEIGHTS) + (MODERNBERT,)


class SequenceClassifier(Protocol):
    """What a cross-encoder runs: sequences packed end to end -> one row of logits each."""

    num_labels: int
    max_input_tokens: int   # longest sequence the model's positions allow, special tokens included
    vocab_size: int
    architecture: str       # config.architectures[0]

    def classify_packed(self, input_ids: torch.Tensor, batch: PackedBatch,
                        token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``[T]`` int64 (``T = batch.lengths.sum()``), ``token_type_ids`` ``[T]`` or None ->
        ``[B, num_labels]`` logits in the model's dtype."""
        ...


class ClassifierHead(nn.Module):
    """``out_proj(tanh(dense(h)))`` on each sequence's first token: ``[B, H]`` -> ``[B, num_labels]``."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class BertSequenceClassifier(nn.Module):
    """A :class:`~pagedserve.models.bert.BertEncoder` with a :class:`ClassifierHead` (HF
    ``*ForSequenceClassification`` of the BERT and RoBERTa families)."""

    def __init__(self, encoder: BertEncoder, num_labels: int):
        super().__init__()
        self.encoder = encoder
        self.head = ClassifierHead(encoder.config.hidden_size, num_labels)
        self.num_labels = num_labels
        self.max_input_tokens = encoder.config.max_input_tokens
        self.vocab_size = encoder.config.vocab_size
        self.architecture = encoder.config.architecture

    def classify_packed(self, input_ids: torch.Tensor, batch: PackedBatch,
                        token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`SequenceClassifier.classify_packed`."""
        hidden = self.encoder.forward_packed(input_ids, batch, token_type_ids)
        starts = torch.cumsum(batch.lengths, 0) - batch.lengths
        return self.head(hidden[starts])


def read_architecture(model_dir: str) -> tuple[str, int]:
    """``(config.architectures[0], num_labels)`` of a HF model directory (``num_labels`` from ``id2label``, else
    ``num_labels``, else HF's default 2).

    Raises:
        FileNotFoundError: no config.json.
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    architecture = (cfg.get("architectures") or [""])[0]
    labels = cfg.get("id2label")
    return architecture, len(labels) if labels else int(cfg.get("num_labels", 2))


def load_head_weights(head: nn.Module, model_dir: str, names: dict[str, str]) -> None:
    """Copy the tensors ``names`` maps (HF name -> our parameter name in ``head``) from the directory's
    safetensors into ``head``.

    Raises:
        ValueError: a tensor missing from the checkpoint, or of the wrong shape.
    """
    params = dict(head.named_parameters())
    found: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                ours = names.get(hf_name)
                if ours is None:
                    continue
                tensor, param = f.get_tensor(hf_name), params[ours]
                if tensor.shape != param.shape:
                    raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(param.shape)}")
                param.data.copy_(tensor)
                found.add(hf_name)
    missing = sorted(set(names) - found)
    if missing:
        raise ValueError(f"{model_dir!r}: classifier weights missing from the checkpoint: {missing}")


def load_sequence_classifier(model_dir: str, device: torch.device | str = "cpu",
                             dtype: torch.dtype = torch.float32) -> SequenceClassifier:
    """Build the sequence classifier of a HF model directory (config.json + safetensors), in eval mode.

    Raises:
        FileNotFoundError: config.json or the weights are missing.
        ValueError: ``architectures[0]`` is not one of :data:`SEQUENCE_CLASSIFIERS`, or what the encoder's
            loader refuses (an unsupported config, unknown, mis-shaped or missing weights).
    """
    architecture, num_labels = read_architecture(model_dir)
    if architecture == MODERNBERT:
        from .modernbert import load_modernbert_classifier

        return load_modernbert_classifier(model_dir, device, dtype)
    if architecture not in _HEAD_WEIGHTS:
        raise ValueError(f"{model_dir!r}: architecture {architecture!r} is not a supported cross-encoder; "
                         f"expected one of {list(SEQUENCE_CLASSIFIERS)}")
    model = BertSequenceClassifier(load_bert(model_dir, device, dtype), num_labels)
    model.head.to(device=device, dtype=dtype)
    dense, out = _HEAD_WEIGHTS[architecture]
    load_head_weights(model.head, model_dir, {f"{dense}.weight": "dense.weight", f"{dense}.bias": "dense.bias",
                                              f"{out}.weight": "out_proj.weight", f"{out}.bias": "out_proj.bias"})
    return model.eval().requires_grad_(False)
