"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI uses.

Engine errors map through their neutral kind (:mod:`pagedserve.serving.caller_errors`), as the gRPC front end maps
the same kinds to its codes: bad input 400, queue full 429, unavailable 503, model not loaded 404; ``param`` is the
field as the body spells it (:class:`~pagedserve.serving.caller_errors.FieldNames`). A request body that fails
validation is 400 (FastAPI's default would be 422) with ``param`` naming the field.
"""
from __future__ import annotations

import math

import structlog
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.caller_errors import SAMPLING_PREFIX, ErrorKind, FieldNames, caller_error

log = structlog.get_logger(__name__)

STATUS_OF: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_INPUT: (400, "invalid_request_error"),
    ErrorKind.DUPLICATE_REQUEST: (400, "invalid_request_error"),
    ErrorKind.QUEUE_FULL: (429, "rate_limit_exceeded"),
    ErrorKind.DEADLINE: (504, "timeout_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.MODEL_NOT_LOADED: (404, "not_found_error"),
    ErrorKind.INTERNAL: (500, "internal_server_error"),
}
"""The HTTP status and OpenAI error type of each error kind."""

BODY_NAMES = FieldNames(prefix=SAMPLING_PREFIX)
"""How any body spells the engine's fields when its endpoint says no more: the sampling fields at the top level."""


class OpenAIError(Exception):
    """An error answered as OpenAI's error body with ``status``; the message starts with ``param`` unless
    ``name_param`` is false (a message whose first words clients match, e.g. the context-length one)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, name_param: bool = True, headers: dict[str, str] | None = None):
        if name_param and param and not message.startswith(f"{param}: "):
            message = f"{param}: {message}"
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers   # response headers (Retry-After on a deadline refusal)


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body; ``code`` is a short string (e.g. "model_not_found") or None, as OpenAI sends it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param, code), status_code=status, headers=headers)


def from_exception(exc: BaseException, fields: FieldNames = BODY_NAMES) -> OpenAIError:
    """The OpenAI error for an exception, naming the field as ``fields`` spell it (an unknown exception is a
    500). A context-length error keeps OpenAI's message and code (``context_length_exceeded``), which clients
    match: its ``param`` names the field, its message does not start with it."""
    if isinstance(exc, OpenAIError):
        return exc
    err = caller_error(exc, fields)
    status, type_ = STATUS_OF[err.kind]
    if err.kind is ErrorKind.INTERNAL:
        log.exception("internal_error", exc_info=exc)
    if err.kind is ErrorKind.DEADLINE:  # Retry-After in whole seconds (RFC 9110 10.2.3), rounded up
        return OpenAIError(status, err.message, type_, err.field, "deadline_exceeded",
                           headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))})
    return OpenAIError(status, err.message, type_, err.field, err.code, name_param=err.code is None)


# pydantic puts the member of a union that failed into ``loc`` (``("input", "list[str]", 0)``); not a body field.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def _loc_to_param(loc: tuple) -> str:
    """pydantic's error location as the client spells the field: ``messages[0].content``."""
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    message = f"{param}: {first.get('msg', 'invalid value')}"
    return error_response(400, message, "invalid_request_error", param)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), type_, None, None, getattr(exc, "headers", None))


async def on_engine_error(request: Request, exc: Exception) -> JSONResponse:
    err = from_exception(exc)
    return error_response(err.status, err.message, err.type, err.param, err.code, err.headers)
