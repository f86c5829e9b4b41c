"""Server interceptors.

- :class:`ErrorMappingInterceptor`: exceptions to gRPC status codes, through the neutral error kinds of
  :mod:`pagedserve.serving.caller_errors`, for unary and streaming handlers alike.
- :class:`CallTrackingInterceptor` (outermost): the gRPC adapter of the process's
  :class:`~pagedserve.serving.calls.CallTracker` (new InferenceService calls refused with UNAVAILABLE once
  shutdown has begun, the calls in flight that shutdown drains), and the gRPC server metrics per method and final
  status code.
- :class:`AuthInterceptor`: API keys on the InferenceService.
- :class:`TracingInterceptor` (with ``--otlp-traces-endpoint``): an OpenTelemetry server span per Generate call.

Each wraps a handler's behaviour once, as a response stream: a unary handler runs as a stream of one response.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from .. import errors
from ..serving.caller_errors import ErrorKind, caller_error, error_kind
from ..serving.calls import CallTracker
from ..serving.tracing import TRACE_HEADERS

log = structlog.get_logger(__name__)

STATUS_OF: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.DUPLICATE_REQUEST: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.MODEL_NOT_LOADED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
"""The status code of each error kind."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code ``exc`` is answered with."""
    return STATUS_OF[error_kind(exc)]


def _status_of(exc: Exception, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    """The status code, message and trailing metadata a handler's exception becomes (logged here). A
    :class:`~pagedserve.errors.DeadlineError` carries a ``google.rpc.RetryInfo`` detail (``grpc-status-details-bin``,
    as grpcio-status's ``rpc_status`` writes and reads it)."""
    err = caller_error(exc)   # the gRPC API names fields as the engine does
    code = STATUS_OF[err.kind]
    if err.kind is ErrorKind.INTERNAL:
        log.error("internal_error", method=method, exc_info=exc)
    else:
        log.info("request_rejected", method=method, code=code.name, error=str(exc))
    trailing = ()
    if isinstance(exc, errors.DeadlineError):
        trailing = (retry_info_trailer(code, err.text(), exc.retry_after_s),)
    return code, err.text(), trailing


def retry_info_trailer(code: grpc.StatusCode, message: str, retry_after_s: float) -> tuple[str, bytes]:
    """The ``grpc-status-details-bin`` trailer of a ``google.rpc.Status`` with a ``RetryInfo`` detail whose
    ``retry_delay`` is ``retry_after_s`` seconds (AIP-194: how long a client should wait before it retries)."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2

    detail = any_pb2.Any()
    whole = int(retry_after_s)
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
        seconds=whole, nanos=int(round((retry_after_s - whole) * 1e9)))))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return "grpc-status-details-bin", status.SerializeToString()


class MalformedRequest:
    """Stands in for a request message that did not parse (bad wire bytes, invalid UTF-8 in a string field), so the
    handler can answer INVALID_ARGUMENT instead of gRPC's INTERNAL "Exception deserializing request"."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error

    def raise_invalid(self):
        raise errors.InvalidInputError(f"the request message does not parse: {self.error}", "request")


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf DecodeError and friends
            return MalformedRequest(exc)
    return deserialize


async def _checked_stream(requests):
    async for request in requests:
        if isinstance(request, MalformedRequest):
            request.raise_invalid()
        yield request


def _check_request(request):
    """A unary request is checked here; a request stream is wrapped so each message is checked as it arrives."""
    if isinstance(request, MalformedRequest):
        request.raise_invalid()
    return request if hasattr(request, "DESCRIPTOR") else _checked_stream(request)


def _as_stream(fn):
    """A unary-response behaviour as a stream of its one response."""
    async def stream(request, context):
        yield await fn(request, context)
    return stream


def _as_unary(stream):
    """A stream of one response as a unary-response behaviour."""
    async def unary(request, context):
        responses = stream(request, context)
        request = response = None  # the stream holds the request while it needs it
        async for response in responses:
            pass
        return response
    return unary


def _rewrap(handler: grpc.RpcMethodHandler, wrap, deserializer=None) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour wrapped by ``wrap`` (which takes and returns a response-stream
    behaviour; a unary response goes through it as a stream of one), and its request deserializer replaced when
    ``deserializer`` is given."""
    args = (deserializer or handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_as_unary(wrap(_as_stream(handler.unary_unary))), *args)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), *args)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_as_unary(wrap(_as_stream(handler.stream_unary))), *args)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), *args)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: :mod:`pagedserve.errors` exceptions become their status codes, anything else INTERNAL
    (logged with its traceback). Errors raised by ``context.abort`` pass through untouched."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return _rewrap(handler, lambda fn: self._wrap(fn, method), _tolerant(handler.request_deserializer))

    # The status is raised outside the `except` block, with the request dropped first: an abort raised inside it
    # would chain the handler's exception, whose traceback holds the frames that hold the request, in a reference
    # cycle that keeps a refused multi-megabyte request alive until the cyclic GC happens to run.
    @staticmethod
    def _wrap(fn, method):
        async def wrapper(request, context):
            try:
                async for item in fn(_check_request(request), context):
                    yield item
                return
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                code, message, trailing = _status_of(exc, method)
            request = None
            await context.abort(code, message, trailing_metadata=trailing)
        return wrapper


def _final_code(context, exc: BaseException | None) -> str:
    """The status name a finished call ends with (what the client sees)."""
    if isinstance(exc, asyncio.CancelledError):
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    code = context.code()
    if code is not None and not isinstance(code, grpc.StatusCode):  # grpc.aio may hand back the core's int
        code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
    if code is not None:
        return code.name
    return "OK" if exc is None else "UNKNOWN"


class CallTrackingInterceptor(grpc.aio.ServerInterceptor):
    """Shutdown gate, in-flight count (the tracker's) and gRPC metrics.

    Args:
        metrics: a :class:`~pagedserve.serving.metrics.ServerMetrics`.
        tracker: the process's call tracker (shared with the HTTP API).
        tracked_service: calls of this service (``pagedserve.v1.InferenceService``) are refused while the tracker
            says so and counted in flight; health and reflection calls are not.
    """

    def __init__(self, metrics, tracker: CallTracker, tracked_service: str):
        self.metrics = metrics
        self.tracker = tracker
        self.tracked_service = tracked_service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        full = handler_call_details.method  # "/package.Service/Method"
        service, _, name = full.lstrip("/").rpartition("/")
        kind = ("bidi_stream" if handler.request_streaming and handler.response_streaming else
                "client_stream" if handler.request_streaming else
                "server_stream" if handler.response_streaming else "unary")
        call = _Call(self, (kind, service, name), service == self.tracked_service, handler.request_streaming)
        return _rewrap(handler, call.wrap)


class _Call:
    """The wrapper of one method's handler (shared by every call of it)."""

    def __init__(self, owner: CallTrackingInterceptor, labels: tuple[str, str, str], tracked: bool,
                 request_streaming: bool):
        self.owner, self.labels, self.tracked = owner, labels, tracked
        self.request_streaming = request_streaming

    async def _enter(self, context) -> float:
        m, tracker = self.owner.metrics, self.owner.tracker
        m.grpc_started.labels(*self.labels).inc()
        if self.tracked:
            reason = tracker.refusal()
            if reason is not None:
                m.grpc_handled.labels(*self.labels, "UNAVAILABLE").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
            tracker.enter()
        return time.perf_counter()

    def _exit(self, context, start: float, exc: BaseException | None) -> None:
        if self.tracked:
            self.owner.tracker.leave()
        m = self.owner.metrics
        m.grpc_handled.labels(*self.labels, _final_code(context, exc)).inc()
        m.grpc_seconds.labels(*self.labels).observe(time.perf_counter() - start)

    def _requests(self, request):
        if not self.request_streaming:
            self.owner.metrics.grpc_msg_received.labels(*self.labels).inc()
            return request
        return self._count_received(request)

    async def _count_received(self, iterator):
        counter = self.owner.metrics.grpc_msg_received.labels(*self.labels)
        async for item in iterator:
            counter.inc()
            yield item

    def wrap(self, fn):
        async def wrapper(request, context):
            start, exc = await self._enter(context), None
            sent = self.owner.metrics.grpc_msg_sent.labels(*self.labels)
            try:
                async for item in fn(self._requests(request), context):
                    sent.inc()
                    yield item
            except BaseException as e:
                exc = e
                raise
            finally:
                self._exit(context, start, exc)
                exc = request = None  # the frame must not hold its own exception (a cycle that pins the request)
        return wrapper


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """``authorization: Bearer <key>`` metadata on every call of ``guarded_service`` (the InferenceService);
    UNAUTHENTICATED otherwise. Health and reflection stay open (Kubernetes probes, grpcurl's listing).

    Args:
        keys: a :class:`~pagedserve.serving.auth.ApiKeys` (constant-time comparison).
        guarded_service: the full service name whose methods need a key.
    """

    def __init__(self, keys, guarded_service: str):
        self.keys = keys
        self.prefix = f"/{guarded_service}/"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.check_authorization(metadata.get("authorization")):
            return handler
        log.info("request_rejected", method=handler_call_details.method, code="UNAUTHENTICATED")

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: "
                                "Bearer <key> metadata)")
            yield  # pragma: no cover - abort raised above

        return _rewrap(handler, lambda fn: refuse)


# Codes that mark a server span failed (OpenTelemetry's semantic conventions for gRPC servers).
SERVER_ERROR_CODES = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
                                "DATA_LOSS"})


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A server span per call of ``methods`` (:meth:`pagedserve.serving.tracing.Tracing.traced`: the caller's
    ``traceparent`` / ``tracestate`` metadata continue its trace), ended with the call's final status code
    (``rpc.grpc.status_code``; status ERROR for the server-side failures, :data:`SERVER_ERROR_CODES`).

    Args:
        tracing: the process's :class:`~pagedserve.serving.tracing.Tracing`.
        methods: full method names, e.g. ``/pagedserve.v1.InferenceService/Generate``.
    """

    def __init__(self, tracing, methods: tuple[str, ...]):
        self.tracing = tracing
        self.methods = frozenset(methods)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or full not in self.methods:
            return handler
        service, _, name = full.lstrip("/").rpartition("/")
        attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        return _rewrap(handler, lambda fn: self._wrap(fn, f"{service}/{name}", attrs))

    def _wrap(self, fn, span_name: str, attrs: dict):
        tracing = self.tracing

        async def wrapper(request, context):
            carrier = {k: v for k, v in context.invocation_metadata() or () if k in TRACE_HEADERS}
            exc = None
            with tracing.traced(carrier, span_name, attrs) as trace:
                try:
                    async for item in fn(request, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    code = _final_code(context, exc)
                    trace.end({"rpc.grpc.status_code": grpc.StatusCode[code].value[0]} if code in
                              grpc.StatusCode.__members__ else None, code if code in SERVER_ERROR_CODES else None)
                    exc = request = None
        return wrapper
