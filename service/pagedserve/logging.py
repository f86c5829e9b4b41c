"""structlog setup: JSON lines when stdout is not a TTY, coloured console output otherwise.

Request-scoped fields (``request_id``) are bound with ``structlog.contextvars`` and appear on every line logged
while a request is being handled.
"""
from __future__ import annotations

import logging
import sys

import structlog


MAX_FIELD_CHARS = 300   # a logged string value longer than this keeps its first characters only


def bound_strings(_logger, _method, event: dict) -> dict:
    """structlog processor: no field value carries more than :data:`MAX_FIELD_CHARS` characters of any string a
    client sent (request ids, error messages quoting input), so a log line stays bounded."""
    for key, value in event.items():
        if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
            event[key] = f"{value[:MAX_FIELD_CHARS]}...[{len(value) - MAX_FIELD_CHARS} more chars]"
    return event


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog and route stdlib logging (grpc, transformers) through the same renderer. String values
    are bounded (:func:`bound_strings`); prompts and outputs are never logged, only their sizes."""
    json = (not sys.stdout.isatty()) if json is None else json
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True), bound_strings]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(logging.getLevelName(level.upper()), logging.WARNING))
