"""Text embeddings with a BERT-family encoder, following a sentence-transformers model directory's own configuration
(``modules.json``: Transformer -> Pooling -> optional Normalize; ``1_Pooling/config.json``;
``sentence_bert_config.json``), as ``SentenceTransformer.encode`` computes them.

Inputs are tokenized, sorted by length and run in micro-batches whose padded size stays under a token budget;
vectors come back in input order. A micro-batch runs packed (see :class:`pagedserve.models.bert.PackedBatch`) and
padded keys are masked in attention, so a text gives the same vector alone or in any batch.
"""
from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from ..models.bert import BertEncoder, PackedBatch, load_bert
from .interface import (EmbeddingModelInfo, EmbedResult, check_dimensions, check_token_id_inputs, finish_vectors,
                        tokenize_inputs)
from .st_config import POOLING_MODES, read_sentence_transformers_config

def pool_packed(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool sequences packed end to end into one vector each (sentence-transformers Pooling semantics).

    Args:
        hidden: ``[T, H]`` float32 token states, sequence b's tokens after those of sequences 0..b-1.
        lengths: ``[B]`` int64 token counts, each >= 1, summing to T.
        mode: "mean" (average of the tokens), "cls" (first token), "lasttoken" (last token).

    Returns:
        ``[B, H]`` float32.
    """
    ends = torch.cumsum(lengths, 0)
    if mode == "cls":
        return hidden[ends - lengths]
    if mode == "lasttoken":
        return hidden[ends - 1]
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.shape[0], device=hidden.device), lengths)
    summed = hidden.new_zeros(lengths.shape[0], hidden.shape[1]).index_add_(0, seq_of_token, hidden)
    return summed / lengths[:, None].to(hidden.dtype)


def plan_micro_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Group input indices by length: sorted shortest first, a batch grows while ``rows * longest`` (its padded
    token count) stays within ``max_batch_tokens``; a single longer input still gets a batch of its own."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and (len(current) + 1) * lengths[i] > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class Embedder:
    """Embeds texts with a BERT encoder plus sentence-transformers pooling / normalization.

    ``embed`` is synchronous; a lock serializes calls, so it may be called from any one (or several) worker
    threads, never on the asyncio event loop.
    """

    def __init__(self, model: BertEncoder, tokenizer, *, name: str, pooling: str, normalize_module: bool,
                 max_input_tokens: int, do_lower_case: bool = False, max_batch_tokens: int = 2048):
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling {pooling!r} is not one of {POOLING_MODES}")
        if not 0 < max_input_tokens <= model.config.max_input_tokens:
            raise ValueError(f"max_input_tokens {max_input_tokens} must be in "
                             f"[1, {model.config.max_input_tokens}] (the model's position table)")
        if max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        self._model, self._tokenizer = model, tokenizer
        self._name, self._pooling, self._normalize_module = name, pooling, normalize_module
        self._max_input_tokens, self._do_lower_case = max_input_tokens, do_lower_case
        self._max_batch_tokens = max_batch_tokens
        param = next(model.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        *, max_batch_tokens: int = 2048, name: str | None = None) -> Embedder:
        """Load a HF or sentence-transformers model directory (BERT family, safetensors weights).

        ``max_input_tokens`` is sentence_bert_config.json's ``max_seq_length`` (else the tokenizer's
        ``model_max_length``), capped by what the position table allows. ``name`` defaults to ``path``.

        Raises:
            FileNotFoundError: ``path`` does not exist, or config.json / weights / a module config is missing.
            ValueError: ``path`` is not a directory, or the model / pipeline is not supported.
        """
        from transformers import AutoTokenizer

        if not os.path.exists(path):
            raise FileNotFoundError(f"embedding model path {path!r} does not exist")
        if not os.path.isdir(path):
            raise ValueError(f"embedding model path {path!r} is not a directory")
        st = read_sentence_transformers_config(path)
        model = load_bert(st.model_dir, device=device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(st.model_dir)
        limit = st.max_seq_length or tokenizer.model_max_length or model.config.max_input_tokens
        return cls(model, tokenizer, name=name or path, pooling=st.pooling, normalize_module=st.normalize,
                   max_input_tokens=min(int(limit), model.config.max_input_tokens),
                   do_lower_case=st.do_lower_case, max_batch_tokens=max_batch_tokens)

    tokenizer = property(lambda self: self._tokenizer, doc="the HF tokenizer (AutoTokenizer) of the model")
    device = property(lambda self: self._device, doc="where the model runs (torch.device)")
    name = property(lambda self: self._name, doc="served model name (defaults to the load path)")
    architecture = property(lambda self: self._model.config.architecture, doc="config.architectures[0]")
    dtype = property(lambda self: str(self._dtype).removeprefix("torch."), doc='weights dtype, e.g. "float32"')
    max_input_tokens = property(lambda self: self._max_input_tokens,
                                doc="longest input in tokens, special tokens included")
    dimension = property(lambda self: self._model.config.hidden_size, doc="length of a full embedding vector")
    pooling = property(lambda self: self._pooling, doc='"mean", "cls" or "lasttoken"')
    normalize_module = property(lambda self: self._normalize_module,
                                doc="the model's pipeline ends in Normalize: its vectors are unit length")
    max_batch_tokens = property(lambda self: self._max_batch_tokens,
                                doc="padded tokens (rows * longest) per micro-batch, unless one input is longer")

    @property
    def info(self) -> EmbeddingModelInfo:
        """The model facts GetModelInfo reports."""
        return EmbeddingModelInfo(self.name, self.architecture, self.dtype, self.max_input_tokens, self.dimension,
                                  self.pooling)

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids per text, special tokens included ([CLS] ... [SEP] for BERT).

        ``truncate`` keeps the first tokens so that each input is at most ``max_input_tokens`` long, special tokens
        included (HF tokenizer truncation, as sentence-transformers does).

        Raises:
            InvalidInputError: field "inputs" for an empty list; "inputs[i]" for a non-string, or for an input longer
                than ``max_input_tokens`` when ``truncate`` is false (the message gives both counts).
        """
        return tokenize_inputs(self._tokenizer, texts, self._max_input_tokens, truncate, self._do_lower_case)

    def embed(self, texts: list[str], normalize: bool = True, truncate: bool = False,
              dimensions: int | None = None) -> EmbedResult:
        """Embed texts (``SentenceTransformer.encode(texts, normalize_embeddings=normalize,
        truncate_dim=dimensions)`` semantics).

        The model's pipeline (pooling, its Normalize module if any) gives ``[N, dimension]`` vectors; ``dimensions``
        = k keeps the first k (Matryoshka, Kusupati et al. 2022); ``normalize`` then L2-normalizes each row.

        Raises:
            InvalidInputError: see :meth:`tokenize`; field "dimensions" when not in ``[1, dimension]``.
        """
        self.check_dimensions(dimensions)
        with self._lock:
            token_ids = self.tokenize(texts, truncate)
            vectors = self._encode(token_ids)
        return EmbedResult(self.finish(vectors, normalize, dimensions), sum(len(seq) for seq in token_ids))

    def embed_token_ids(self, token_ids: list[list[int]], normalize: bool = True, truncate: bool = False,
                        dimensions: int | None = None) -> EmbedResult:
        """Like :meth:`embed` for already tokenized inputs (special tokens included, as :meth:`tokenize` gives).

        Raises:
            InvalidInputError: see :func:`~pagedserve.embedding.interface.check_token_id_inputs`; "dimensions" as
                in :meth:`embed`.
        """
        self.check_dimensions(dimensions)
        token_ids = self.check_token_ids(token_ids, truncate)
        with self._lock:
            vectors = self._encode(token_ids)
        return EmbedResult(self.finish(vectors, normalize, dimensions), sum(len(seq) for seq in token_ids))

    def check_token_ids(self, token_ids: list[list[int]], truncate: bool = False) -> list[list[int]]:
        """Token id inputs checked against ``max_input_tokens`` and the vocabulary (cut with ``truncate``)."""
        return check_token_id_inputs(token_ids, self._max_input_tokens, self._model.config.vocab_size, truncate)

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raises InvalidInputError (field "dimensions") unless ``dimensions`` is None or in ``[1, dimension]``."""
        check_dimensions(dimensions, self.dimension)

    finish = staticmethod(finish_vectors)

    def encode_micro_batch(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Run one micro-batch as is (no regrouping): the model's pipeline vectors (pooled, then its Normalize
        module if any), ``[len(token_ids), dimension]`` float32 on CPU, row i for sequence i.

        ``token_ids`` come from :meth:`tokenize` (checked lengths); the caller picks the grouping (padding is
        masked, so the grouping never changes a vector). Thread safe: calls are serialized.
        """
        with self._lock, torch.inference_mode():
            out = self._forward_batch(token_ids)
        return F.normalize(out, p=2, dim=-1) if self._normalize_module else out

    def _encode(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Pooled (and, with a Normalize module, normalized) vectors ``[N, dimension]`` float32 CPU, input order."""
        out = torch.empty(len(token_ids), self.dimension, dtype=torch.float32)
        lengths = [len(seq) for seq in token_ids]
        with torch.inference_mode():
            for batch in plan_micro_batches(lengths, self._max_batch_tokens):
                out[batch] = self._forward_batch([token_ids[i] for i in batch])
        if self._normalize_module:
            out = F.normalize(out, p=2, dim=-1)
        return out

    def _forward_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        """Run one micro-batch, packed (no padding outside attention): ``[b, dimension]`` float32 on CPU."""
        batch = PackedBatch.from_lengths([len(seq) for seq in seqs], self._device)
        input_ids = torch.tensor([t for seq in seqs for t in seq], dtype=torch.int64).to(self._device)
        hidden = self._model.forward_packed(input_ids, batch)
        return pool_packed(hidden.float(), batch.lengths, self._pooling).cpu()
