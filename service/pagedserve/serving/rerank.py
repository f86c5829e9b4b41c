"""Rerank and Score, front-end neutral: both APIs check and run them here, over the process's
:class:`~pagedserve.embedding.scoring.ScoringService` (a cross-encoder, else the embedding model's cosine).

Rerank scores each text against the query and returns them best first (ties in input order), at most ``top_n``;
errors name ``query``, ``texts``, ``texts[i]`` and ``top_n`` (the gRPC names; a front end whose body spells them
otherwise renames them with its :class:`~pagedserve.serving.caller_errors.FieldNames`). Score passes its pairs
through as the scoring service checks them (``text_1``, ``text_2``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..embedding.scoring import ScoreResult, ScoringService
from ..errors import InvalidInputError
from .caller_errors import FieldNames, caller_error

RERANK_FIELDS = FieldNames(renames={"text_1[0]": "query", "text_2": "texts"})
"""How Rerank names the scoring service's fields: the query is the one ``text_1``, the texts are ``text_2``."""


@dataclass(frozen=True, slots=True)
class RankedText:
    """One text of a rerank answer."""

    index: int     # its position in the request's texts
    score: float   # the scoring service's score of (query, text)


@dataclass(frozen=True, slots=True)
class RerankResult:
    """The answer to one rerank call."""

    results: list[RankedText]   # best first (ties: lower index first), at most top_n
    prompt_tokens: int          # tokens run through the model over all pairs (or texts), special tokens included


def renamed(exc: InvalidInputError, fields: FieldNames) -> InvalidInputError:
    """``exc`` naming its field as ``fields`` spell it."""
    err = caller_error(exc, fields)
    return InvalidInputError(err.message, field=err.field)


async def rerank(scorer: ScoringService, query: str, texts: list[str], top_n: int | None = None,
                 truncate: bool = False, raw: bool = False) -> RerankResult:
    """Score every text against ``query`` and order them best first, keeping the first ``top_n`` (all when None
    or more than there are); ``raw``: a cross-encoder's logits, before its activation.

    Raises:
        InvalidInputError: "query" (not a string, or empty), "texts" (none), "top_n" (< 1), "texts[i]" (not a
            string, or the pair too long without ``truncate``).
        QueueFullError, EngineUnavailableError: from the scoring service.
    """
    if not isinstance(query, str) or not query:
        raise InvalidInputError("must be a non-empty string", field="query")
    if not texts:
        raise InvalidInputError("at least one text is required", field="texts")
    if top_n is not None and top_n < 1:
        raise InvalidInputError(f"must be >= 1, got {top_n}", field="top_n")
    try:
        result = await scorer.score([query], list(texts), truncate, raw)
    except InvalidInputError as exc:
        raise renamed(exc, RERANK_FIELDS) from None
    scores = result.scores
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    return RerankResult([RankedText(i, scores[i]) for i in order], result.prompt_tokens)


async def score(scorer: ScoringService, text_1: list[str], text_2: list[str], truncate: bool = False
                ) -> ScoreResult:
    """Scores of the pairs in input order (1 -> N or N -> N, see :mod:`pagedserve.embedding.scoring`).

    Raises:
        InvalidInputError: "text_1", "text_2", "text_1[i]", "text_2[i]" (see
            :func:`~pagedserve.embedding.cross_encoder.check_pairing`; too long without ``truncate``).
    """
    return await scorer.score(list(text_1), list(text_2), truncate)
