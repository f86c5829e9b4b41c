"""Cross-encoder scores of text pairs, as sentence-transformers' ``CrossEncoder.predict`` computes them.

A pair is tokenized with the tokenizer's own pair template (``tokenizer(text_1, text_2)``: ``[CLS] a [SEP] b [SEP]``
with segment ids for BERT, ``<s> a </s></s> b </s>`` for the RoBERTa family), cut with ``truncation="longest_first"``
to ``max_length`` when asked, run through the sequence classifier (:mod:`pagedserve.models.cross_encoder`) packed
(padded keys masked, so a pair scores the same alone or in any batch), and the logits go through the model's
activation: the one sentence-transformers saved with it (``config_sentence_transformers.json`` ``activation_fn`` in
a directory it saved, i.e. one with a ``modules.json``; else ``config.json``'s ``sentence_transformers.activation_fn``
or older ``sbert_ce_default_activation_function``), else Sigmoid for one label and Identity for more
(``CrossEncoder.get_default_activation_fn``).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from ..models.bert import PackedBatch
from ..models.cross_encoder import SequenceClassifier, load_sequence_classifier
from ..text_bounds import check_text_can_fit
from .encoder import plan_micro_batches
from .st_config import read_sentence_transformers_config

# sentence-transformers' activation paths (``fullname`` of the module it saved) -> our name and function.
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": ("sigmoid", torch.sigmoid),
    "torch.nn.modules.linear.Identity": ("identity", lambda x: x),
    "torch.nn.modules.activation.Tanh": ("tanh", torch.tanh),
}
_BY_NAME = {name: fn for name, fn in ACTIVATIONS.values()}


@dataclass(frozen=True, slots=True)
class PairTokens:
    """One tokenized pair: what the model reads."""

    ids: list[int]               # token ids, special tokens included
    type_ids: list[int] | None   # segment ids when the tokenizer gives them (BERT), else None (all 0)

    def __len__(self) -> int:
        return len(self.ids)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_activation(path: str, model_dir: str, num_labels: int) -> str:
    """The activation sentence-transformers' ``CrossEncoder`` applies to this model's logits, by our name
    ("sigmoid", "identity", "tanh"); see the module docstring for where it is read.

    Raises:
        ValueError: a saved activation other than those in :data:`ACTIVATIONS`.
    """
    saved = None
    if os.path.isfile(os.path.join(path, "modules.json")):   # sentence-transformers reads it only then
        saved = _read_json(os.path.join(path, "config_sentence_transformers.json")).get("activation_fn")
    config = _read_json(os.path.join(model_dir, "config.json"))
    if saved is None:
        saved = (config.get("sentence_transformers") or {}).get("activation_fn")
    if saved is None:
        saved = config.get("sbert_ce_default_activation_function")
    if saved is None:
        return "sigmoid" if num_labels == 1 else "identity"
    if saved not in ACTIVATIONS:
        raise ValueError(f"{path!r}: activation_fn {saved!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[saved][0]


def check_pairing(text_1: list[str], text_2: list[str]) -> None:
    """The pairing rule of a score call: ``text_2`` holds at least one text, ``text_1`` one (scored against every
    ``text_2``) or as many as ``text_2`` (pair i is ``(text_1[i], text_2[i])``); every entry a string,
    ``text_1``'s not empty.

    Raises:
        InvalidInputError: naming "text_2", "text_1", "text_1[i]" or "text_2[i]".
    """
    if not text_2:
        raise InvalidInputError("at least one text is required", field="text_2")
    if len(text_1) not in (1, len(text_2)):
        raise InvalidInputError(f"has {len(text_1)} texts: give 1 (scored against every text_2) or "
                                f"{len(text_2)} (one per text_2)", field="text_1")
    for name, texts in (("text_1", text_1), ("text_2", text_2)):
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidInputError(f"must be a string, got {type(text).__name__}", field=f"{name}[{i}]")
    for i, text in enumerate(text_1):
        if not text:
            raise InvalidInputError("must not be empty", field=f"text_1[{i}]")


class CrossEncoder:
    """Scores text pairs with a sequence-classification model (``CrossEncoder.predict`` semantics).

    :meth:`encode_micro_batch` is what :class:`~pagedserve.embedding.batcher.EmbedBatcher` runs on its worker
    thread (as for an :class:`~pagedserve.embedding.encoder.Embedder`); calls are serialized by a lock, so any
    thread may call, never the asyncio event loop.
    """

    def __init__(self, model: SequenceClassifier, tokenizer, *, name: str, max_input_tokens: int,
                 activation: str, do_lower_case: bool = False, max_batch_tokens: int = 2048):
        if activation not in _BY_NAME:
            raise ValueError(f"activation {activation!r} is not one of {sorted(_BY_NAME)}")
        if not 0 < max_input_tokens <= model.max_input_tokens:
            raise ValueError(f"max_input_tokens {max_input_tokens} must be in [1, {model.max_input_tokens}] "
                             "(the model's positions)")
        self._model, self._tokenizer, self._name = model, tokenizer, name
        self._max_input_tokens, self._activation = max_input_tokens, activation
        self._do_lower_case, self._max_batch_tokens = do_lower_case, max_batch_tokens
        self._types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        param = next(model.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        *, max_batch_tokens: int = 2048, name: str | None = None) -> CrossEncoder:
        """Load a cross-encoder directory (HF ``*ForSequenceClassification`` checkpoint, or a sentence-transformers
        CrossEncoder saved with ``save_pretrained``). ``max_input_tokens`` is sentence_bert_config.json's
        ``max_seq_length``, else the tokenizer's ``model_max_length``, capped by the model's positions (as
        sentence-transformers caps it). ``name`` defaults to ``path``.

        Raises:
            FileNotFoundError: ``path`` does not exist, or config.json / the weights are missing.
            ValueError: not a directory, an unsupported architecture or config, an unsupported activation.
        """
        from transformers import AutoTokenizer

        if not os.path.exists(path):
            raise FileNotFoundError(f"rerank model path {path!r} does not exist")
        if not os.path.isdir(path):
            raise ValueError(f"rerank model path {path!r} is not a directory")
        st = read_sentence_transformers_config(path)
        model = load_sequence_classifier(st.model_dir, device=device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(st.model_dir)
        limit = min(int(st.max_seq_length or tokenizer.model_max_length or model.max_input_tokens),
                    model.max_input_tokens)
        return cls(model, tokenizer, name=name or path, max_input_tokens=limit,
                   activation=read_activation(path, st.model_dir, model.num_labels),
                   do_lower_case=st.do_lower_case, max_batch_tokens=max_batch_tokens)

    tokenizer = property(lambda self: self._tokenizer, doc="the HF tokenizer (AutoTokenizer) of the model")
    device = property(lambda self: self._device, doc="where the model runs (torch.device)")
    name = property(lambda self: self._name, doc="served model name (defaults to the load path)")
    architecture = property(lambda self: self._model.architecture, doc="config.architectures[0]")
    dtype = property(lambda self: str(self._dtype).removeprefix("torch."), doc='weights dtype, e.g. "float32"')
    max_input_tokens = property(lambda self: self._max_input_tokens,
                                doc="longest pair in tokens, special tokens included")
    num_labels = property(lambda self: self._model.num_labels, doc="logits per pair")
    dimension = num_labels   # the batcher's name for the width of one output row
    activation = property(lambda self: self._activation, doc='"sigmoid", "identity" or "tanh"')

    def tokenize_pairs(self, text_1: list[str], text_2: list[str], truncate: bool = False) -> list[PairTokens]:
        """Pair i is ``(text_1[i], text_2[i])``, or ``(text_1[0], text_2[i])`` when ``text_1`` holds one text,
        tokenized with the tokenizer's pair template; ``truncate`` cuts the longer side first
        (``truncation="longest_first"``) to ``max_input_tokens``.

        Raises:
            InvalidInputError: see :func:`check_pairing`; "text_2[i]" for a pair longer than ``max_input_tokens``
                without ``truncate`` (the message gives both counts).
        """
        check_pairing(text_1, text_2)
        firsts = text_1 * len(text_2) if len(text_1) == 1 else list(text_1)
        limit = self._max_input_tokens
        if not truncate:   # refuse what cannot fit from its length, before tokenizing it
            for i, (a, b) in enumerate(zip(firsts, text_2)):
                check_text_can_fit(len(a.encode("utf-8")) + len(b.encode("utf-8")), limit, self._tokenizer,
                                   f"text_2[{i}]")
        if self._do_lower_case:
            firsts, text_2 = [t.lower() for t in firsts], [t.lower() for t in text_2]
        enc = self._tokenizer(firsts, list(text_2), truncation="longest_first" if truncate else False,
                              max_length=limit if truncate else None, verbose=False)
        types = enc.get("token_type_ids") if self._types else None
        pairs = [PairTokens(ids, types[i] if types is not None else None) for i, ids in enumerate(enc["input_ids"])]
        for i, pair in enumerate(pairs):
            if len(pair) > limit:
                raise InvalidInputError(f"the pair has {len(pair)} tokens, more than the model's limit of {limit} "
                                        f"tokens (set truncate to cut it to {limit})", field=f"text_2[{i}]")
        return pairs

    def encode_micro_batch(self, pairs: list[PairTokens]) -> torch.Tensor:
        """Run one micro-batch as is: raw logits ``[len(pairs), num_labels]`` float32 on CPU, row i for pair i
        (:meth:`activate` gives the scores). Padding is masked, so the grouping never changes a row. Thread safe:
        calls are serialized."""
        with self._lock, torch.inference_mode():
            return self._forward_batch(pairs)

    def activate(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's activation (see the module docstring) applied to ``[N, num_labels]`` float32 logits."""
        return _BY_NAME[self._activation](logits)

    def predict(self, pairs: list[tuple[str, str]], truncate: bool = True) -> torch.Tensor:
        """``CrossEncoder.predict(pairs)``: activated logits ``[N, num_labels]`` float32 on CPU, in input order,
        micro-batched by length here (``CrossEncoder.predict`` truncates, hence the default).

        Raises:
            InvalidInputError: see :meth:`tokenize_pairs`.
        """
        tokens = self.tokenize_pairs([a for a, _ in pairs], [b for _, b in pairs], truncate) if pairs else []
        out = torch.empty(len(tokens), self.num_labels)
        with self._lock, torch.inference_mode():
            for batch in plan_micro_batches([len(p) for p in tokens], self._max_batch_tokens):
                out[batch] = self._forward_batch([tokens[i] for i in batch])
        return self.activate(out)

    def _forward_batch(self, pairs: list[PairTokens]) -> torch.Tensor:
        batch = PackedBatch.from_lengths([len(p) for p in pairs], self._device)
        ids = torch.tensor([t for p in pairs for t in p.ids], dtype=torch.int64).to(self._device)
        types = None
        if self._types and pairs[0].type_ids is not None:
            types = torch.tensor([t for p in pairs for t in p.type_ids], dtype=torch.int64).to(self._device)
        return self._model.classify_packed(ids, batch, types).float().cpu()
