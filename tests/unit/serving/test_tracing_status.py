"""A traced call's span status (README "Tracing"): server-side failures set ``error.type`` and status ERROR, a
caller's error and success do not; for the gRPC adapter (grpc_api.interceptors.TracingInterceptor) and the HTTP one
(http.tracing.TracingMiddleware), spans exported to the tests' in-process OTLP collector."""
from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from otlp_collector import OtlpCollector, attributes

from pagedserve.grpc_api.interceptors import TracingInterceptor
from pagedserve.http.tracing import TracingMiddleware
from pagedserve.serving.tracing import Tracing

STATUS_CODE_ERROR = 2   # OTLP Status.code


@pytest.fixture(scope="module")
def traced():
    collector = OtlpCollector()
    tracing = Tracing.from_config(collector.start(), {})
    yield collector, tracing
    tracing.shutdown()
    collector.stop()


class FakeContext:
    """What TracingInterceptor reads of a grpc.aio ServicerContext."""

    def __init__(self, trace_id: str, code: grpc.StatusCode | None = None):
        self.metadata = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),)
        self._code = code

    def invocation_metadata(self):
        return self.metadata

    def code(self):
        return self._code

    def time_remaining(self):
        return None


def grpc_call(tracing, trace_id: str, fail: BaseException | None, code: grpc.StatusCode | None) -> None:
    async def handler(request, context):
        yield "token"
        if fail is not None:
            raise fail

    wrapped = TracingInterceptor(tracing, ())._wrap(handler, "pagedserve.v1.InferenceService/Generate", {})

    async def drive():
        async for _ in wrapped(None, FakeContext(trace_id, code)):
            pass

    try:
        asyncio.run(drive())
    except type(fail) if fail is not None else ():
        pass


def http_call(tracing, trace_id: str, status: int) -> None:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"traceparent", f"00-{trace_id}-00f067aa0ba902b7-01".encode())]}

    async def noop(*_):
        return {"type": "http.request", "body": b""}

    asyncio.run(TracingMiddleware(app, tracing)(scope, noop, noop))


def span_of(collector, tracing, trace_id: str):
    (span,) = collector.wait_trace(tracing, trace_id, 1)
    return span, attributes(span)


@pytest.mark.parametrize("fail, code, want_error", [
    (None, None, None),                                                    # OK
    (RuntimeError("boom"), None, "UNKNOWN"),                               # an unexpected exception
    (RuntimeError("aborted"), grpc.StatusCode.INTERNAL, "INTERNAL"),
    (RuntimeError("aborted"), grpc.StatusCode.INVALID_ARGUMENT, None),     # the caller's error
    (RuntimeError("aborted"), grpc.StatusCode.RESOURCE_EXHAUSTED, None),
])
def test_grpc_span_status(traced, fail, code, want_error):
    collector, tracing = traced
    trace_id = uuid.uuid4().hex
    grpc_call(tracing, trace_id, fail, code)
    span, attrs = span_of(collector, tracing, trace_id)
    want_code = (code or (grpc.StatusCode.UNKNOWN if fail else grpc.StatusCode.OK)).value[0]
    assert attrs["rpc.grpc.status_code"] == want_code
    assert attrs.get("error.type") == want_error
    assert (span.status.code == STATUS_CODE_ERROR) == (want_error is not None)


@pytest.mark.parametrize("status, want_error", [(200, None), (400, None), (504, "504"), (500, "500")])
def test_http_span_status(traced, status, want_error):
    collector, tracing = traced
    trace_id = f"{status:032x}"
    http_call(tracing, trace_id, status)
    span, attrs = span_of(collector, tracing, trace_id)
    assert attrs["http.response.status_code"] == status and attrs.get("error.type") == want_error
    assert (span.status.code == STATUS_CODE_ERROR) == (want_error is not None)
