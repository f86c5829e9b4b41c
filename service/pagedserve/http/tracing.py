"""The HTTP adapter of tracing (``--otlp-traces-endpoint``): a pure ASGI middleware that opens an OpenTelemetry
server span for each POST to ``/v1/chat/completions`` and ``/v1/completions``
(:meth:`pagedserve.serving.tracing.Tracing.traced`: the request's ``traceparent`` / ``tracestate`` headers continue
the caller's trace) and ends it once the response has been sent, a streamed one included, with its
``http.response.status_code`` (status ERROR for a 5xx, or an exception). Installed only when tracing is on.
"""
from __future__ import annotations

from ..serving.tracing import TRACE_HEADERS, Tracing

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}   # path -> gen_ai operation


class TracingMiddleware:
    """Wraps ``app`` (see the module docstring); other paths and methods pass straight through."""

    def __init__(self, app, tracing: Tracing):
        self.app, self.tracing = app, tracing

    async def __call__(self, scope, receive, send):
        operation = OPERATIONS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if operation is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        carrier = {}
        for key, value in scope.get("headers", ()):
            name = key.decode("latin-1").lower()
            if name in TRACE_HEADERS:
                carrier[name] = value.decode("latin-1")
        status: list[int] = []

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        attrs = {"http.request.method": "POST", "url.path": scope["path"], "gen_ai.operation.name": operation}
        with self.tracing.traced(carrier, operation, attrs) as trace:
            error = None
            try:
                await self.app(scope, receive, send_noting_status)
            except BaseException as exc:
                error = type(exc).__qualname__
                raise
            finally:
                code = status[0] if status else None
                if error is None and code is not None and code >= 500:
                    error = str(code)
                trace.end({"http.response.status_code": code} if code is not None else None, error)
