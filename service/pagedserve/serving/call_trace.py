"""One traced API call: its server span, started when the call arrived, and the spans built from the engine's
recorded times when it ends (vLLM's way: while the call runs, only monotonic times are noted).

The span of a generation call (``SpanKind.SERVER``, named ``"{gen_ai.operation.name} {gen_ai.request.model}"``,
e.g. ``"chat SmolLM2-135M-Instruct"``) carries the GenAI semantic conventions' request and usage attributes and
vLLM's latency attributes, and has these children per engine request (one per prompt), which follow each other:

- ``preprocess``: the call's arrival until it is handed to the engine (checks, chat template, tokenizing);
- ``queue``: handed to the engine until first scheduled;
- ``prefill``: first scheduled until the first token, with one ``prefill_chunk`` child per step that computed
  prompt tokens (chunked prefill: ``pagedserve.prefill.tokens`` each);
- ``decode``: the first token until the last, with a ``detokenize`` event (``pagedserve.detokenize_s``: the time
  the incremental detokenizer took for this request, over every step);

and a ``first_token`` event on the call's span. Times are the engine's monotonic clock mapped to epoch nanoseconds
with one offset per call, so the children's durations are the engine's own differences.
"""
from __future__ import annotations

import time

from opentelemetry import trace as otel_trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from ..outputs import EngineTimings
from ..sampling_params import SamplingParams

# vLLM's latency attribute names (vllm/tracing.py SpanAttributes), seconds.
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
TIME_IN_INFERENCE = "gen_ai.latency.time_in_model_inference"
TIME_IN_DETOKENIZE = "pagedserve.latency.time_in_detokenize"


class CallTrace:
    """The trace of one call (made by :meth:`pagedserve.serving.tracing.Tracing.start_call`).

    Args:
        tracer: the server's tracer (children are started on it).
        span: the call's server span, started now.
        start: ``time.monotonic()`` when the call arrived (the span's start).
        offset_ns: epoch nanoseconds minus monotonic nanoseconds, fixed for the call.
    """

    def __init__(self, tracer, span: Span, start: float, offset_ns: int):
        self.tracer, self.span, self.start, self._offset_ns = tracer, span, start, offset_ns
        self.recording = span.is_recording()   # sampled: the engine records its times and the children are built
        ctx = span.get_span_context()
        self.trace_id, self.span_id = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
        self.calls: list[EngineTimings] = []    # one per engine request, in prompt order

    def ns(self, t: float) -> int:
        """Epoch nanoseconds of monotonic second ``t``."""
        return int(t * 1e9) + self._offset_ns

    def describe(self, operation: str, model: str, params: SamplingParams) -> None:
        """Name the span after the request and set its GenAI request attributes (``operation``: "chat" or
        "text_completion")."""
        self.span.update_name(f"{operation} {model}")
        attrs = {"gen_ai.operation.name": operation, "gen_ai.request.model": model, "gen_ai.response.model": model,
                 "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                 "gen_ai.request.choice.count": params.n}
        optional = {"gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.seed": params.seed,
                    "gen_ai.request.top_k": params.top_k or None}
        attrs.update({k: v for k, v in optional.items() if v is not None})
        self.span.set_attributes(attrs)

    def engine_timings(self, request_id: str) -> EngineTimings | None:
        """A new engine request's timings to fill (handed to ``AsyncEngine.generate``); None when the call is not
        sampled (nothing is recorded for it). The first one's ``request_id`` is the span's ``gen_ai.request.id``
        (vLLM's attribute)."""
        if not self.recording:
            return None
        if not self.calls:
            self.span.set_attribute("gen_ai.request.id", request_id)
        self.calls.append(EngineTimings(time.monotonic()))
        return self.calls[-1]

    def set_result(self, input_tokens: int, output_tokens: int, cached_tokens: int,
                   finish_reasons: list[str]) -> None:
        """The call's usage and its choices' finish reasons (in choice order)."""
        self.span.set_attributes({"gen_ai.usage.input_tokens": input_tokens,
                                  "gen_ai.usage.output_tokens": output_tokens,
                                  "gen_ai.usage.cache_read.input_tokens": cached_tokens,
                                  "gen_ai.response.finish_reasons": finish_reasons})

    def end(self, attributes: dict | None = None, error_type: str | None = None) -> None:
        """Build the children from the recorded times, set the latency attributes and ``attributes``, and end the
        span now; ``error_type`` marks it failed (``error.type``, status ERROR)."""
        end = time.monotonic()
        if self.recording:
            for i, t in enumerate(self.calls):
                self._children(t, i if len(self.calls) > 1 else None, end)
            self.span.set_attributes(self._latencies(end))
        if attributes:
            self.span.set_attributes(attributes)
        if error_type is not None:
            self.span.set_attribute("error.type", error_type)
            self.span.set_status(Status(StatusCode.ERROR, error_type))
        self.span.end(end_time=self.ns(end))

    def _latencies(self, end: float) -> dict[str, float]:
        out = {E2E: end - self.start}
        firsts = [t.first_token for t in self.calls if t.first_token is not None]
        if firsts:
            out[TIME_TO_FIRST_TOKEN] = min(firsts) - self.start
        if self.calls:
            t = self.calls[0]
            out[TIME_IN_DETOKENIZE] = sum(c.detokenize_s for c in self.calls)
            if t.first_scheduled is not None:
                out[TIME_IN_QUEUE] = t.first_scheduled - t.submitted
            if t.first_token is not None:
                out[TIME_IN_PREFILL] = t.first_token - t.first_scheduled
                out[TIME_IN_DECODE] = t.last_token - t.first_token
                out[TIME_IN_INFERENCE] = t.last_token - t.first_scheduled
        return out

    def _child(self, name: str, start: float, end: float, attributes: dict, parent: Span | None = None) -> Span:
        span = self.tracer.start_span(name, context=otel_trace.set_span_in_context(parent or self.span),
                                      kind=SpanKind.INTERNAL, attributes=attributes, start_time=self.ns(start))
        span.end(end_time=self.ns(max(start, end)))
        return span

    def _children(self, t: EngineTimings, prompt_index: int | None, end: float) -> None:
        """The spans of one engine request (its times so far: a call cut short has fewer)."""
        base = {} if prompt_index is None else {"pagedserve.prompt_index": prompt_index}
        self._child("preprocess", self.start, t.submitted, base)
        self._child("queue", t.submitted, t.first_scheduled or end, base)
        if t.first_scheduled is None:
            return
        prefill_end = t.first_token or (t.prefill_chunks[-1][1] if t.prefill_chunks else end)
        prefill = self.tracer.start_span(
            "prefill", context=otel_trace.set_span_in_context(self.span), start_time=self.ns(t.first_scheduled),
            attributes={**base, "pagedserve.prefill.chunks": len(t.prefill_chunks),
                        "pagedserve.prefill.tokens": sum(c[2] for c in t.prefill_chunks),
                        "gen_ai.usage.cache_read.input_tokens": t.num_cached_tokens})
        for k, (a, b, n) in enumerate(t.prefill_chunks):
            self._child("prefill_chunk", a, b, {**base, "pagedserve.prefill.chunk": k,
                                                "pagedserve.prefill.tokens": n}, parent=prefill)
        prefill.end(end_time=self.ns(prefill_end))
        if t.first_token is None:
            return
        self.span.add_event("first_token", base, timestamp=self.ns(t.first_token))
        decode = self.tracer.start_span(
            "decode", context=otel_trace.set_span_in_context(self.span), start_time=self.ns(t.first_token),
            attributes={**base, "pagedserve.decode.steps": t.num_decode_steps,
                        "pagedserve.num_preemptions": t.num_preemptions})
        decode.add_event("detokenize", {**base, "pagedserve.detokenize_s": t.detokenize_s},
                         timestamp=self.ns(t.last_token))
        decode.end(end_time=self.ns(t.last_token))
