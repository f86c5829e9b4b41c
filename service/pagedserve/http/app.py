"""The ASGI app of the OpenAI-compatible API: routes, and one middleware for what every request goes through.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``, ``GET /v1/models``,
``GET /v1/models/{model}``,
``GET /health``, ``GET /metrics`` (the server's Prometheus registry), ``POST /tokenize``, ``POST /detokenize``
(vLLM's shapes); and what a router in front of several replicas asks (:mod:`.fleet_routes`):
``POST /v1/chat/completions/render``, ``POST /v1/completions/render``, ``GET /get_load``; rerank and score
(:mod:`.rerank_routes`): ``POST /rerank`` (TEI's shape), ``POST /v1/rerank``, ``POST /v2/rerank`` (Jina's and
Cohere's), ``POST /score``, ``POST /v1/score`` (vLLM's).

:class:`GateMiddleware`: API keys (``Authorization: Bearer``, :class:`~pagedserve.serving.auth.ApiKeys`) on
``/v1/*``, ``/v2/*``, ``/tokenize``, ``/detokenize``, ``/rerank`` and ``/score`` (``/health`` and ``/metrics`` stay
open); 413 for a body over
``max_request_body_bytes`` (by Content-Length, or counted as a chunked body arrives); and the HTTP adapter of the
process's :class:`~pagedserve.serving.calls.CallTracker`: 503 for API calls once shutdown has begun, API requests
(streams included) counted in flight, which shutdown drains. CORS preflights pass the
gate to starlette's CORS middleware (vLLM's flags: ``allowed_origins``, ``allowed_methods``, ``allowed_headers``,
``allow_credentials``; default any origin, method and header).
"""
from __future__ import annotations

import functools

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ServerConfig
from ..errors import PagedServeError
from ..serving.auth import ApiKeys
from ..serving.callers import caller_of
from ..serving.calls import CallTracker
from ..serving.metrics import ServerMetrics
from ..serving.prompts import ChatPrompt, TextPrompt
from ..serving.services import Services
from . import convert as cv
from . import errors
from .fleet_routes import build_router as build_fleet_router
from .openai_serving import OpenAIServing
from .rerank_routes import build_router as build_rerank_router
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                       TokenizeRequest)
from .tracing import TracingMiddleware

API_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/rerank", "/score")


class GateMiddleware:
    """Pure ASGI middleware (streams pass through untouched); see the module docstring."""

    def __init__(self, app, tracker: CallTracker, api_keys: ApiKeys, max_body_bytes: int):
        self.app, self.tracker, self.max_body_bytes = app, tracker, max_body_bytes
        self.api_keys = api_keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        is_api = path.startswith(API_PREFIXES)
        if _is_preflight(scope):  # answered by the CORS middleware; browsers send no credentials with it
            return await self.app(scope, receive, send)
        if is_api and not self.api_keys.check_authorization(_header(scope, b"authorization")):
            return await self._reply(send, 401, "invalid or missing API key (Authorization: Bearer <key>)",
                                     "authentication_error", {"www-authenticate": "Bearer"})
        refusal = self.tracker.refusal() if is_api else None
        if refusal is not None:
            return await self._reply(send, 503, refusal, "service_unavailable")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._reply(send, 413, f"request body of {length} bytes is over the limit of "
                                     f"{self.max_body_bytes} bytes", "invalid_request_error")
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._buffered(receive)  # a chunked body: read (bounded) before the app sees it
            if receive is None:
                return await self._reply(send, 413, f"request body is over the limit of {self.max_body_bytes} "
                                         "bytes", "invalid_request_error")
        if not is_api:
            return await self.app(scope, receive, send)
        self.tracker.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.tracker.leave()

    async def _buffered(self, receive):
        """The whole body read up front, replayed as one message; None when it grows past the limit."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()
        return replay

    @staticmethod
    async def _reply(send, status: int, message: str, type_: str, headers: dict | None = None) -> None:
        response = errors.error_response(status, message, type_, headers=headers)
        await response({"type": "http"}, None, send)


def _is_preflight(scope) -> bool:
    """A CORS preflight: OPTIONS with an Origin and Access-Control-Request-Method."""
    return scope["method"] == "OPTIONS" and _header(scope, b"origin") is not None and \
        _header(scope, b"access-control-request-method") is not None


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def build_app(config: ServerConfig, services: Services, metrics: ServerMetrics, api_keys: ApiKeys,
              tracker: CallTracker | None = None) -> tuple[FastAPI, GateMiddleware]:
    """The FastAPI app and its gate, counting API requests in ``tracker`` (the process's, which shutdown drains;
    default: one of its own)."""
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    serving = OpenAIServing(services, config.auto_tool_parser,
                            functools.partial(caller_of, config.fair_share_by, keys=api_keys))
    app.add_exception_handler(errors.OpenAIError, errors.on_openai_error)
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)
    app.add_exception_handler(StarletteHTTPException, errors.on_http_error)
    app.add_exception_handler(PagedServeError, errors.on_engine_error)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        return await serving.embeddings(body)

    started_s = cv.now_s()

    def card(name: str) -> dict:
        """vLLM's model card: ``created`` is the server's start (unix seconds), ``max_model_len`` the longest
        context (the generation model's; the embedding model's longest input); for the generation model also what
        it is (:meth:`OpenAIServing.model_details`)."""
        return {"id": name, "object": "model", "created": started_s, "owned_by": "pagedserve", "root": name,
                "parent": None, "max_model_len": serving.max_model_len(name), **serving.model_details(name)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name) for name in serving.model_names()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """OpenAI's retrieve-model (the SDK's ``models.retrieve``); 404 ``model_not_found`` for another name."""
        if model not in serving.model_names():
            raise errors.OpenAIError(404, f"The model `{model}` does not exist", "not_found_error", "model",
                                     "model_not_found")
        return card(model)

    @app.get("/health")
    async def health():
        ready = not services.loading and not services.shutting_down
        return Response(status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        generation = services.require_generation()
        if (body.prompt is None) == (body.messages is None):
            raise errors.OpenAIError(400, "exactly one of prompt or messages is required", param="prompt")
        if body.messages is not None:
            chat = cv.chat_prompt(ChatCompletionRequest(messages=body.messages,
                                                        chat_template_kwargs=body.chat_template_kwargs))
            prompt = ChatPrompt(chat.messages, body.add_generation_prompt, template_kwargs=chat.template_kwargs)
        else:
            prompt = TextPrompt(body.prompt, body.add_special_tokens)
        ids, strs = await generation.tokenize(prompt)
        out = {"count": len(ids), "max_model_len": generation.info.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = strs
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's: the text of the ids, special tokens kept (so a rendered chat prompt tokenizes back to them)."""
        text = services.require_generation().detokenize(body.tokens, skip_special_tokens=False, field="tokens")
        return {"prompt": text}

    app.include_router(build_fleet_router(services))
    app.include_router(build_rerank_router(services))
    app.add_middleware(CORSMiddleware, allow_origins=config.cors_list("allowed_origins"),
                       allow_methods=config.cors_list("allowed_methods"),
                       allow_headers=config.cors_list("allowed_headers"), allow_credentials=config.allow_credentials)
    inner = app if services.tracing is None else TracingMiddleware(app, services.tracing)
    gate = GateMiddleware(inner, tracker or CallTracker(services), api_keys, config.max_request_body_bytes)
    return app, gate

