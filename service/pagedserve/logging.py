"""structlog setup: JSON lines when stdout is not a TTY, coloured console output otherwise.

Request-scoped fields (``request_id``) are bound with ``structlog.contextvars`` and appear on every line logged
while a request is being handled.
"""
from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog and route stdlib logging (grpc, transformers) through the same renderer."""
    json = (not sys.stdout.isatty()) if json is None else json
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True)]
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
