"""Rerank and score over HTTP, in the shapes retrieval clients already speak; every route runs
:mod:`pagedserve.serving.rerank` (the cross-encoder, else the embedding model's cosine), as gRPC Rerank / Score do.

``POST /rerank`` (text-embeddings-inference's): body ``{query, texts, raw_scores?, return_text?, truncate?,
truncation_direction?}``; answer a list of ``{index, score, text?}``, best first. ``raw_scores`` gives the logits
before the cross-encoder's activation.

``POST /v1/rerank`` and ``POST /v2/rerank`` (Jina's and Cohere's, as vLLM serves them): body ``{model?, query,
documents (strings or {text}), top_n?, return_documents? (default true), truncate?}``; answer ``{id, model,
results: [{index, relevance_score, document?: {text}}], usage: {prompt_tokens, total_tokens}, meta:
{api_version, billed_units: {input_tokens}}}``, results best first. Cohere's ``max_tokens_per_doc`` (cut each
document) is refused naming it: ``truncate`` cuts a (query, document) pair to the model's limit instead.

``POST /score`` and ``POST /v1/score`` (vLLM's): body ``{model?, text_1, text_2, truncate?}`` (each a string or a
list: one text_1 against every text_2, or pair by pair); answer ``{id, object: "list", created, model, data:
[{index, object: "score", score}], usage}`` in input order.

Every body also takes vLLM's ``truncate_prompt_tokens`` (any value truncates, as for embeddings). A pair longer
than the model's limit without truncation is a 400 naming the text (``texts[i]``, ``documents[i]``,
``text_2[i]``), as are an empty query, no texts and ``top_n`` < 1; another ``model`` is a 404.
"""
from __future__ import annotations

from fastapi import APIRouter

from ..serving.caller_errors import FieldNames
from ..serving.rerank import rerank, score
from ..serving.services import Services
from .convert import new_id, now_s
from .errors import OpenAIError
from .openai_serving import _naming_fields as naming_fields
from .protocol import _Body


class TeiRerankRequest(_Body):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = False
    truncation_direction: str = "Right"
    truncate_prompt_tokens: int | None = None


class DocumentObject(_Body):
    text: str


class CohereRerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str | DocumentObject]
    top_n: int | None = None
    return_documents: bool = True
    truncate: bool = False
    truncate_prompt_tokens: int | None = None
    max_tokens_per_doc: int | None = None


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate: bool = False
    truncate_prompt_tokens: int | None = None


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def build_router(services: Services) -> APIRouter:
    """The five routes over ``services`` (mounted by :func:`pagedserve.http.app.build_app`)."""
    router = APIRouter()

    def check_model(model: str | None) -> str:
        scorer = services.require_rerank()
        served = services.rerank_name or scorer.info.name
        if model is None or model == served:
            return served
        raise OpenAIError(404, f"The model `{model}` does not exist (this server reranks with `{served}`)",
                          "not_found_error", "model", "model_not_found")

    @router.post("/rerank")
    async def tei_rerank(body: TeiRerankRequest) -> list[dict]:
        if body.truncation_direction.lower() != "right":
            raise OpenAIError(400, "only Right truncation (keep the first tokens) is supported",
                              param="truncation_direction")
        truncate = body.truncate or body.truncate_prompt_tokens is not None
        result = await naming_fields(rerank(services.require_rerank(), body.query, body.texts, None, truncate,
                                            body.raw_scores), FieldNames())
        return [{"index": r.index, "score": r.score, **({"text": body.texts[r.index]} if body.return_text else {})}
                for r in result.results]

    async def cohere_rerank(body: CohereRerankRequest, version: str) -> dict:
        if body.max_tokens_per_doc is not None:
            raise OpenAIError(400, "is not supported: send truncate: true to cut each (query, document) pair to "
                              "the model's limit", param="max_tokens_per_doc")
        model = check_model(body.model)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        truncate = body.truncate or body.truncate_prompt_tokens is not None
        result = await naming_fields(rerank(services.require_rerank(), body.query, texts, body.top_n, truncate),
                                     FieldNames(renames={"texts": "documents"}))
        results = [{"index": r.index, "relevance_score": r.score,
                    **({"document": {"text": texts[r.index]}} if body.return_documents else {})}
                   for r in result.results]
        tokens = result.prompt_tokens
        return {"id": new_id("rerank"), "model": model, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "meta": {"api_version": {"version": version}, "billed_units": {"input_tokens": tokens}}}

    @router.post("/v1/rerank")
    async def v1_rerank(body: CohereRerankRequest) -> dict:
        return await cohere_rerank(body, "1")

    @router.post("/v2/rerank")
    async def v2_rerank(body: CohereRerankRequest) -> dict:
        return await cohere_rerank(body, "2")

    async def vllm_score(body: ScoreRequest) -> dict:
        model = check_model(body.model)
        renames = {f"{name}[0]": name for name in ("text_1", "text_2") if isinstance(getattr(body, name), str)}
        truncate = body.truncate or body.truncate_prompt_tokens is not None
        result = await naming_fields(score(services.require_rerank(), _as_list(body.text_1), _as_list(body.text_2),
                                           truncate), FieldNames(renames=renames))
        tokens = result.prompt_tokens
        return {"id": new_id("score"), "object": "list", "created": now_s(), "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(result.scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    @router.post("/score")
    async def score_route(body: ScoreRequest) -> dict:
        return await vllm_score(body)

    @router.post("/v1/score")
    async def v1_score(body: ScoreRequest) -> dict:
        return await vllm_score(body)

    return router
