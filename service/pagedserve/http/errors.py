"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI uses.

Engine errors (:mod:`pagedserve.errors`) map here as they map to gRPC codes in the gRPC front end: bad input 400,
queue full 429, unavailable 503, model not loaded 404. A request body that fails validation is 400 (FastAPI's
default would be 422) with ``param`` naming the field.
"""
from __future__ import annotations

import re

import structlog
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import errors

log = structlog.get_logger(__name__)

_STATUS_OF: list[tuple[type[BaseException], int, str]] = [
    (errors.InvalidInputError, 400, "invalid_request_error"),
    (errors.DuplicateRequestError, 400, "invalid_request_error"),
    (errors.QueueFullError, 429, "rate_limit_exceeded"),
    (errors.EngineUnavailableError, 503, "service_unavailable"),
    (errors.ModelNotLoadedError, 404, "not_found_error"),
]


class OpenAIError(Exception):
    """An error answered as OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        if param and not message.startswith(f"{param}: "):
            message = f"{param}: {message}"
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body; ``code`` is a short string (e.g. "model_not_found") or None, as OpenAI sends it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param, code), status_code=status, headers=headers)


def from_exception(exc: BaseException) -> OpenAIError:
    """The OpenAI error for an engine exception (an unknown one is a 500)."""
    if isinstance(exc, OpenAIError):
        return exc
    for cls, status, type_ in _STATUS_OF:
        if isinstance(exc, cls):
            field = getattr(exc, "field", None)
            param = public_param(field)
            message = str(exc)
            if field and message.startswith(f"{field}: "):
                message = message[len(field) + 2:]
            return OpenAIError(status, message, type_, param)
    log.exception("internal_error", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error")


def public_param(field: str | None) -> str | None:
    """The engine's field name as the HTTP body names it (``sampling.temperature`` -> ``temperature``)."""
    if field is None:
        return None
    return field.removeprefix("sampling.")


# pydantic puts the member of a union that failed into ``loc`` (``("input", "list[str]", 0)``); not a body field.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def as_sent(exc: errors.PagedServeError, renames: dict[str, str]) -> errors.PagedServeError:
    """``exc`` with its field's leading name replaced as ``renames`` says (the engine's ``max_tokens`` ->
    the body's ``max_completion_tokens``, ``inputs[1]`` -> ``input[1]``), so ``param`` is the field as sent."""
    field = public_param(exc.field)
    head = re.match(r"[A-Za-z_]*(\[0\])?", field or "").group(0)
    if head not in renames:
        head = re.match(r"[A-Za-z_]*", field or "").group(0)
    if not head or head not in renames:
        return exc
    message = str(exc).removeprefix(f"{exc.field}: ")
    return type(exc)(message, renames[head] + field[len(head):])


def _loc_to_param(loc: tuple) -> str:
    """pydantic's error location as the client spells the field: ``messages[0].content``."""
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)


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
    return error_response(err.status, err.message, err.type, err.param, err.code)
