"""An in-process OTLP trace collector for the tracing tests and bench/tracing_ab.py: a gRPC server implementing
``opentelemetry.proto.collector.trace.v1.TraceService/Export`` (the ``opentelemetry-proto`` messages and stubs) that
keeps every span it receives, with its resource's attributes. Optionally it keeps only counts (a benchmark's sink)."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def any_value(value):
    """An OTLP ``AnyValue`` as a Python value (arrays as lists)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return None if kind is None else getattr(value, kind)


def attributes(item) -> dict:
    """The attributes of a span, an event or a resource, as a dict."""
    return {a.key: any_value(a.value) for a in item.attributes}


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """Start with :meth:`start` (returns the ``http://127.0.0.1:PORT`` endpoint), stop with :meth:`stop`.

    Args:
        keep: keep the spans (False: count them only).
    """

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.spans: list = []              # opentelemetry.proto.trace.v1.Span, in arrival order
        self.resources: list[dict] = []    # the resource attributes of each span in `spans`
        self.num_spans = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                resource = attributes(rs.resource)
                for ss in rs.scope_spans:
                    self.num_spans += len(ss.spans)
                    if self.keep:
                        self.spans.extend(ss.spans)
                        self.resources.extend([resource] * len(ss.spans))
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)

    def trace(self, trace_id: str) -> list:
        """The spans received so far of trace ``trace_id`` (32 hex digits)."""
        with self._lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]

    def wait_for(self, tracing, found, what: str, timeout_s: float = 30.0):
        """Flush ``tracing`` (the server's :class:`~pagedserve.serving.tracing.Tracing`) until ``found()`` returns
        something truthy (an HTTP call's span ends just after its last byte went out); returns that."""
        deadline = time.monotonic() + timeout_s
        while not (result := found()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            tracing.force_flush()
            time.sleep(0.02)
        return result

    def wait_trace(self, tracing, trace_id: str, num_spans: int) -> list:
        """The spans of trace ``trace_id`` once ``num_spans`` of them are here."""
        return self.wait_for(tracing, lambda: s if len(s := self.trace(trace_id)) >= num_spans else None,
                             f"{num_spans} spans of trace {trace_id}")

    def wait_server_span(self, tracing, request_id: str):
        """The SERVER span whose ``gen_ai.request.id`` is ``request_id``, once it is here."""
        def found():
            with self._lock:
                return next((s for s in self.spans if s.kind == 2 and
                             attributes(s).get("gen_ai.request.id") == request_id), None)
        return self.wait_for(tracing, found, f"the span of {request_id}")
