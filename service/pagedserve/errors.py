"""Exceptions the engine raises; the server's interceptor maps each to one gRPC status code.

Every client-caused error names the offending request field (``field``), so the status message does too.
"""
from __future__ import annotations


class PagedServeError(Exception):
    """Base class. ``field`` names the request field at fault, when there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class InvalidInputError(PagedServeError, ValueError):
    """Bad request content -> INVALID_ARGUMENT."""


class DuplicateRequestError(PagedServeError):
    """A live request already has this request_id -> ALREADY_EXISTS."""


class QueueFullError(PagedServeError):
    """The waiting queue is full -> RESOURCE_EXHAUSTED."""


class EngineUnavailableError(PagedServeError):
    """Shutting down, or the engine loop has died -> UNAVAILABLE."""


class ModelNotLoadedError(PagedServeError):
    """The RPC needs a model that is not loaded (Embed without an embedding model) -> FAILED_PRECONDITION."""


class DeadlineError(PagedServeError):
    """The request cannot finish before its deadline (or waited ``--max-queue-time-s``) and was refused before any
    prefill -> DEADLINE_EXCEEDED (HTTP 504). ``retry_after_s``: seconds after which a retry may find room (the
    ``google.rpc.RetryInfo`` detail, HTTP ``Retry-After``)."""

    def __init__(self, message: str, field: str | None = None, retry_after_s: float = 1.0):
        super().__init__(message, field)
        self.retry_after_s = retry_after_s
