"""Scores of text pairs behind one interface (:class:`ScoringService`), what Rerank and Score run on: a
cross-encoder behind the cross-call batcher (:class:`CrossEncoderScorer`), or, where no cross-encoder is loaded,
the cosine of the two texts' vectors from the embedding model (:class:`EmbeddingScorer`, as vLLM's ``/score`` does
for embedding models).

A call scores pairs ``(text_1[i], text_2[i])``, or ``(text_1[0], text_2[i])`` when ``text_1`` holds one text (1 -> N,
a rerank); errors name ``text_1[i]`` / ``text_2[i]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..errors import InvalidInputError
from .batcher import EmbedBatcher
from .cross_encoder import CrossEncoder, check_pairing
from .interface import EmbeddingService

CROSS_ENCODER = "cross-encoder"
EMBEDDING_COSINE = "embedding-cosine"


@dataclass(frozen=True, slots=True)
class RerankModelInfo:
    """What GetModelInfo and the ready line report about the model that scores pairs."""

    name: str               # served name (the load path, or the embedding model's for the cosine fallback)
    kind: str               # CROSS_ENCODER or EMBEDDING_COSINE
    architecture: str       # config.architectures[0]
    dtype: str              # weights dtype, e.g. "float32"
    max_input_tokens: int   # longest pair (cross-encoder) or text (embedding), special tokens included
    activation: str         # what maps a logit to the score: "sigmoid", "identity", "tanh"; "cosine" for embeddings


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """The answer to one ``score`` call."""

    scores: list[float]     # one per pair, in input order
    prompt_tokens: int      # tokens run through the model, special tokens included, after truncation


@runtime_checkable
class ScoringService(Protocol):
    """The pair scorer as the front ends see it. Implementations run on the asyncio event loop."""

    info: RerankModelInfo

    async def score(self, text_1: list[str], text_2: list[str], truncate: bool = False,
                    raw: bool = False) -> ScoreResult:
        """Score pairs (see the module docstring); ``truncate`` cuts what is longer than ``max_input_tokens``;
        ``raw`` gives a cross-encoder's logit before its activation (TEI's ``raw_scores``; a cosine is raw).

        Raises:
            InvalidInputError: see :func:`~pagedserve.embedding.cross_encoder.check_pairing`; "text_1[i]" /
                "text_2[i]" for an input too long without ``truncate``.
            QueueFullError, EngineUnavailableError: the service cannot take the call now.
        """
        ...

    async def aclose(self) -> None:
        """Stop the service (a no-op where it borrows another service's model)."""
        ...


class CrossEncoderScorer:
    """A :class:`~pagedserve.embedding.cross_encoder.CrossEncoder` behind an :class:`EmbedBatcher`: the pairs of
    concurrent calls share micro-batches. The model must give one score per pair (``num_labels == 1``, as
    ``CrossEncoder.rank`` requires).

    Raises:
        ValueError: at construction, for a model with more than one label.
    """

    def __init__(self, batcher: EmbedBatcher):
        model: CrossEncoder = batcher.embedder
        if model.num_labels != 1:
            raise ValueError(f"rerank_model: {model.name!r} has {model.num_labels} labels; reranking needs a "
                             "cross-encoder with one score per pair (num_labels 1, as CrossEncoder.rank requires)")
        self.batcher, self.model = batcher, model
        self.info = RerankModelInfo(model.name, CROSS_ENCODER, model.architecture, model.dtype,
                                    model.max_input_tokens, model.activation)

    async def score(self, text_1: list[str], text_2: list[str], truncate: bool = False,
                    raw: bool = False) -> ScoreResult:
        """See :meth:`ScoringService.score`; the scores are ``CrossEncoder.predict``'s."""
        pairs = await self.batcher.tokenize(self.model.tokenize_pairs, text_1, text_2, truncate)
        rows = await self.batcher.run(pairs, None if raw else self.model.activate)
        return ScoreResult(rows[:, 0].tolist(), sum(map(len, pairs)))

    async def aclose(self) -> None:
        self.batcher.close()


class EmbeddingScorer:
    """Cosine similarity of the two texts' embeddings (vLLM's ``/score`` on an embedding model): ``text_1`` and
    ``text_2`` embedded in one call (so they batch together; a 1 -> N query once), vectors L2-normalized, the score
    their dot product."""

    def __init__(self, embedding: EmbeddingService):
        self.embedding = embedding
        emb = embedding.info
        self.info = RerankModelInfo(emb.name, EMBEDDING_COSINE, emb.architecture, emb.dtype, emb.max_input_tokens,
                                    "cosine")

    async def score(self, text_1: list[str], text_2: list[str], truncate: bool = False,
                    raw: bool = False) -> ScoreResult:
        """See :meth:`ScoringService.score`; scores in [-1, 1] (``raw`` changes nothing)."""
        check_pairing(text_1, text_2)
        try:
            result = await self.embedding.embed(list(text_1) + list(text_2), normalize=True, truncate=truncate)
        except InvalidInputError as exc:   # "inputs[k]" -> the pair field it came from
            raise _renamed(exc, len(text_1)) from None
        left, right = result.vectors[:len(text_1)], result.vectors[len(text_1):]
        scores = (left * right).sum(dim=-1).clamp(-1.0, 1.0)
        return ScoreResult(scores.to(torch.float32).tolist(), result.prompt_tokens)

    async def aclose(self) -> None:
        """Nothing to stop: the embedding service is closed by its owner."""


def _renamed(exc: InvalidInputError, num_text_1: int) -> InvalidInputError:
    field = exc.field or ""
    if not field.startswith("inputs["):
        return exc
    k = int(field[len("inputs["):field.index("]")])
    name = f"text_1[{k}]" if k < num_text_1 else f"text_2[{k - num_text_1}]"
    message = str(exc).removeprefix(f"{field}: ")
    return InvalidInputError(message, field=name)
