"""What every embedding service offers the front ends (gRPC ``Embed``, HTTP ``/v1/embeddings``), whichever model
serves: a BERT-family encoder behind the cross-call batcher (:mod:`.batcher`), or a decoder model's last-token
pooling through an engine (:mod:`.decoder`). Also the input checks and post-processing they share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from ..text_bounds import check_text_can_fit

EmbedInputs = list[str] | list[list[int]]   # texts, or token id sequences (special tokens included)


@dataclass(frozen=True, slots=True)
class EmbeddingModelInfo:
    """What GetModelInfo and the startup line report about the embedding model."""

    name: str               # served name (the load path, or the generation model's for "llm")
    architecture: str       # config.architectures[0]
    dtype: str              # weights dtype, e.g. "float32"
    max_input_tokens: int   # longest input, special tokens included
    dimension: int          # length of a full vector
    pooling: str            # "mean", "cls" or "lasttoken"


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """The answer to one ``embed`` call."""

    vectors: torch.Tensor   # [N, D'] float32 on CPU, row i for input i; D' = dimensions or the model's dimension
    prompt_tokens: int      # tokens run through the model over all inputs, special tokens included, after truncation




@runtime_checkable
class EmbeddingService(Protocol):
    """The embedding model as the front ends see it. Implementations run on the asyncio event loop."""

    info: EmbeddingModelInfo

    async def embed(self, inputs: EmbedInputs, normalize: bool = True, truncate: bool = False,
                    dimensions: int | None = None) -> EmbedResult:
        """Embed texts or token id sequences: ``[N, D']`` float32 vectors in input order
        (``SentenceTransformer.encode(inputs, normalize_embeddings=normalize, truncate_dim=dimensions)``
        semantics); ``truncate`` keeps each input's first ``max_input_tokens`` tokens.

        Raises:
            InvalidInputError: "inputs" (empty), "inputs[i]" (not a string or id list, empty, too long without
                truncate, id out of the vocabulary), "dimensions" (not in ``[1, dimension]``).
            QueueFullError, EngineUnavailableError: the service cannot take the call now.
        """
        ...

    async def aclose(self) -> None:
        """Stop the service; calls still waiting get EngineUnavailableError."""
        ...


def tokenize_inputs(tokenizer, texts: list[str], limit: int, truncate: bool = False,
                    lower_case: bool = False) -> list[list[int]]:
    """Token ids per text with the model's special tokens (``add_special_tokens=True``), for the Embed API.

    ``truncate`` keeps the first tokens so that each input is at most ``limit`` long, special tokens included (HF
    tokenizer truncation, as sentence-transformers does); ``lower_case`` lowercases the texts first.

    Raises:
        InvalidInputError: field "inputs" for an empty list; "inputs[i]" for a non-string, a text that tokenizes to
            nothing, or one longer than ``limit`` when ``truncate`` is false (the message gives both counts).
    """
    if not texts:
        raise InvalidInputError("at least one input is required", field="inputs")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInputError(f"must be a string, got {type(text).__name__}", field=f"inputs[{i}]")
    if not truncate:  # refuse what cannot fit from its length, before tokenizing it
        for i, text in enumerate(texts):
            check_text_can_fit(len(text.encode("utf-8")), limit, tokenizer, f"inputs[{i}]")
    if lower_case:
        texts = [t.lower() for t in texts]
    ids = tokenizer(list(texts), add_special_tokens=True, truncation=truncate,
                    max_length=limit if truncate else None, verbose=False)["input_ids"]
    for i, seq in enumerate(ids):
        if not seq:
            raise InvalidInputError("tokenizes to no tokens", field=f"inputs[{i}]")
        if len(seq) > limit:
            raise InvalidInputError(f"input has {len(seq)} tokens, more than the model's limit of {limit} "
                                    f"tokens (set truncate to keep the first {limit})", field=f"inputs[{i}]")
    return ids


def check_dimensions(dimensions: int | None, dimension: int) -> None:
    """Raises InvalidInputError (field "dimensions") unless ``dimensions`` is None or in ``[1, dimension]``."""
    if dimensions is not None and not 0 < dimensions <= dimension:
        raise InvalidInputError(f"must be in [1, {dimension}], got {dimensions}", field="dimensions")


def check_token_id_inputs(token_ids: list[list[int]], limit: int, vocab_size: int,
                          truncate: bool = False) -> list[list[int]]:
    """Token id inputs checked (and, with ``truncate``, cut to their first ``limit`` ids).

    Raises:
        InvalidInputError: "inputs" for an empty list; "inputs[i]" for an empty sequence, a non-integer or
            out-of-vocabulary id, or a sequence longer than ``limit`` without ``truncate``.
    """
    if not token_ids:
        raise InvalidInputError("at least one input is required", field="inputs")
    out = []
    for i, seq in enumerate(token_ids):
        if not seq:
            raise InvalidInputError("must not be empty", field=f"inputs[{i}]")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
            raise InvalidInputError("token ids must be integers", field=f"inputs[{i}]")
        if min(seq) < 0 or max(seq) >= vocab_size:
            raise InvalidInputError(f"token ids must be in [0, {vocab_size})", field=f"inputs[{i}]")
        if len(seq) > limit and not truncate:
            raise InvalidInputError(f"input has {len(seq)} tokens, more than the model's limit of {limit} "
                                    f"tokens (set truncate to keep the first {limit})", field=f"inputs[{i}]")
        out.append(list(seq[:limit]))
    return out


def is_token_id_inputs(inputs: EmbedInputs) -> bool:
    """True when ``inputs`` are token id sequences rather than texts (decided by the first one)."""
    return bool(inputs) and isinstance(inputs[0], (list, tuple))


def finish_vectors(vectors: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """The API's post-processing of pipeline vectors ``[N, dimension]`` float32: keep the first ``dimensions``
    columns (all when None; Matryoshka, Kusupati et al. 2022), then L2-normalize rows when ``normalize``.
    Returns ``[N, D']`` contiguous."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        vectors = F.normalize(vectors, p=2, dim=-1)
    return vectors.contiguous()
