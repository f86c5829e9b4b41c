"""OpenTelemetry tracing of generation calls, exported over OTLP to ``--otlp-traces-endpoint`` (vLLM's flag); off
(no tracer, no exporter, nothing recorded) without it.

:class:`Tracing` is the process's setup: its own ``TracerProvider`` (never the global one: two servers in one
process keep apart), a ``BatchSpanProcessor`` and the OTLP exporter (gRPC by default; HTTP/protobuf when the URL's
path ends in ``/v1/traces`` or ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` is
``http/protobuf``), the sampler of ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default
``parentbased_always_on``), the resource of ``OTEL_SERVICE_NAME`` (default ``pagedserve``) and
``OTEL_RESOURCE_ATTRIBUTES``; the variables are read in :mod:`pagedserve.envs`.

The front ends open a call with :meth:`Tracing.traced` (gRPC: an interceptor on Generate; HTTP: a middleware on the
completions routes): it reads the caller's W3C ``traceparent`` / ``tracestate`` (gRPC metadata, HTTP headers; a
call without a valid one starts a new trace), starts the server span, binds ``trace_id`` and ``span_id`` into
structlog's context (so every log line of the call carries them) and makes the :class:`CallTrace` the current one
(:func:`current_call_trace`), which the request pipeline fills.
"""
from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

import structlog
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..envs import OtelSettings, otel_settings
from .call_trace import CallTrace

SAMPLERS = ("parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio", "always_on",
            "always_off", "traceidratio")
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_SERVICE_NAME = "pagedserve"
TRACE_HEADERS = ("traceparent", "tracestate")   # W3C Trace Context: the only headers read
_PROPAGATOR = TraceContextTextMapPropagator()
_current: ContextVar[CallTrace | None] = ContextVar("pagedserve_call_trace", default=None)


def current_call_trace() -> CallTrace | None:
    """The call being traced in this task (None: tracing off, or not in a traced call)."""
    return _current.get()


@dataclass(frozen=True, slots=True)
class TracingSetup:
    """What tracing was set up with (the ready line and GetModelInfo say it)."""

    endpoint: str        # the OTLP URL spans are exported to
    protocol: str        # "grpc" or "http/protobuf"
    sampler: str         # an OTEL_TRACES_SAMPLER name
    sampler_arg: float   # the ratio of the traceidratio samplers (1.0 otherwise)
    service_name: str
    resource_attributes: dict[str, str]   # from OTEL_RESOURCE_ATTRIBUTES
    schedule_delay_ms: float | None       # batch export delay (None: the SDK's, 5 s)


def _bad(variable: str, value, expected: str) -> ValueError:
    return ValueError(f"{variable}: {value!r} is not {expected}")


def tracing_setup(endpoint: str, env: OtelSettings) -> TracingSetup:
    """Check and resolve the settings. Raises ValueError naming the variable that is wrong."""
    sampler = (env.sampler or "parentbased_always_on").strip().lower()
    if sampler not in SAMPLERS:
        raise _bad("OTEL_TRACES_SAMPLER", env.sampler, f"one of {', '.join(SAMPLERS)}")
    ratio = 1.0
    if sampler.endswith("traceidratio") and env.sampler_arg is not None:
        try:
            ratio = float(env.sampler_arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise _bad("OTEL_TRACES_SAMPLER_ARG", env.sampler_arg, "a ratio in [0, 1]")
    path = urllib.parse.urlsplit(endpoint).path
    protocol = (env.protocol or ("http/protobuf" if path.rstrip("/").endswith("/v1/traces") else "grpc")).lower()
    if protocol not in PROTOCOLS:
        raise _bad("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.protocol, f"one of {', '.join(PROTOCOLS)}")
    if protocol == "http/protobuf" and path.strip("/") == "":
        endpoint = endpoint.rstrip("/") + "/v1/traces"   # a collector's base URL: the traces path appended
    resource = {}
    for item in (env.resource_attributes or "").split(","):
        key, eq, value = item.partition("=")
        if not item.strip():
            continue
        if not eq or not key.strip():
            raise _bad("OTEL_RESOURCE_ATTRIBUTES", env.resource_attributes, "a list of key=value pairs")
        resource[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    delay = None
    if env.schedule_delay_ms is not None:
        try:
            delay = float(env.schedule_delay_ms)
        except ValueError:
            delay = -1.0
        if delay < 0:
            raise _bad("OTEL_BSP_SCHEDULE_DELAY", env.schedule_delay_ms, "milliseconds >= 0")
    return TracingSetup(endpoint, protocol, sampler, ratio, env.service_name or DEFAULT_SERVICE_NAME, resource,
                        delay)


def _sampler(setup: TracingSetup):
    from opentelemetry.sdk.trace import sampling

    base = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
            "traceidratio": sampling.TraceIdRatioBased(setup.sampler_arg)}[setup.sampler.removeprefix("parentbased_")]
    return sampling.ParentBased(base) if setup.sampler.startswith("parentbased_") else base


def _exporter(setup: TracingSetup):
    if setup.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=setup.endpoint, insecure=setup.endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=setup.endpoint)


class Tracing:
    """The process's tracer (see the module docstring). Build it with :meth:`from_config`.

    Args:
        setup: the resolved settings.
    """

    def __init__(self, setup: TracingSetup):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.setup = setup
        resource = Resource.create({**setup.resource_attributes, "service.name": setup.service_name})
        self.provider = TracerProvider(sampler=_sampler(setup), resource=resource, shutdown_on_exit=False)
        self.exporter = _exporter(setup)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter, schedule_delay_millis=setup.schedule_delay_ms))
        self.tracer = self.provider.get_tracer("pagedserve")

    @classmethod
    def from_config(cls, endpoint: str | None, environ: Mapping[str, str] | None = None) -> Tracing | None:
        """Tracing to ``endpoint`` (``ServerConfig.otlp_traces_endpoint``) with the ``OTEL_*`` variables of
        ``environ`` (default: the process's); None (nothing created) when ``endpoint`` is None or empty.
        Raises ValueError naming a bad variable."""
        if not endpoint:
            return None
        return cls(tracing_setup(endpoint, otel_settings(environ)))

    def info(self) -> dict:
        """The setup in a few fields (the ready line's ``tracing``)."""
        s = self.setup
        sampler = s.sampler + (f":{s.sampler_arg:g}" if s.sampler.endswith("traceidratio") else "")
        return {"otlp_traces_endpoint": s.endpoint, "protocol": s.protocol, "sampler": sampler,
                "service_name": s.service_name}

    def start_call(self, carrier: Mapping[str, str], name: str, attributes: dict) -> CallTrace:
        """Start a call's server span now, as a child of the caller's ``traceparent`` in ``carrier`` (lower-case
        header names), or as a new trace."""
        parent = _PROPAGATOR.extract({k: carrier[k] for k in TRACE_HEADERS if k in carrier})
        offset_ns = time.time_ns() - time.monotonic_ns()
        start = time.monotonic()
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes,
                                      start_time=int(start * 1e9) + offset_ns)
        return CallTrace(self.tracer, span, start, offset_ns)

    @contextlib.contextmanager
    def traced(self, carrier: Mapping[str, str], name: str, attributes: dict) -> Iterator[CallTrace]:
        """A traced call (see the module docstring): yields its :class:`CallTrace`, current while inside; the
        caller ends it (:meth:`CallTrace.end`). The log context and the current trace are cleared on exit."""
        trace = self.start_call(carrier, name, attributes)
        _current.set(trace)
        structlog.contextvars.bind_contextvars(trace_id=trace.trace_id, span_id=trace.span_id)
        try:
            yield trace
        finally:
            _current.set(None)
            structlog.contextvars.unbind_contextvars("trace_id", "span_id")

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export every ended span now; False when it did not finish within ``timeout_s``."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocks up to the exporter's timeout). Idempotent."""
        self.provider.shutdown()
