"""OpenTelemetry tracing (--otlp-traces-endpoint), against an in-process OTLP collector (tests/otlp_collector.py):
a gRPC and an HTTP call that carry a W3C ``traceparent`` get a server span in that trace, under the caller's span,
with the GenAI attributes, and queue / prefill (one chunk per step) / decode children whose durations add up to
the call's; a call without one starts a new trace; an unsampled parent exports nothing; every log line of a call
carries its trace id; with tracing off nothing is created and nothing recorded.

One traced server (a 2-layer random Llama, 64-token step budget so a prompt prefills in several chunks) and one
untraced server sharing its weights, both for the module."""
from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
import structlog
from structlog.testing import capture_logs

from fleet_helpers import write_tiny_llama
from otlp_collector import OtlpCollector, attributes
from support import ServerThread, free_port, server_sharing_model
from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc

pytestmark = pytest.mark.e2e

STEP_TOKENS = 64
PROMPT = "Tell me everything about lighthouses, their keepers and the ships they guide. " * 6
SERVER, INTERNAL = 2, 1   # OTLP Span.SpanKind values


def traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


@pytest.fixture(scope="module")
def collector():
    c = OtlpCollector()
    endpoint = c.start()
    yield c, endpoint
    c.stop()


@pytest.fixture(scope="module")
def traced(collector, tmp_path_factory):
    from pagedserve.config import EngineConfig, ServerConfig

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tracing"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_SERVICE_NAME", "pagedserve-under-test")
        s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=free_port(), embedding_model="",
                                      otlp_traces_endpoint=collector[1]),
                         EngineConfig(model=model_dir, device="cpu", dtype="float32", attention_backend="torch",
                                      quantization="none", num_kv_blocks=256, max_model_len=2048, max_num_seqs=8,
                                      max_num_batched_tokens=STEP_TOKENS, enforce_eager=True))
    with grpc.insecure_channel(s.target) as channel:   # warm (the chat template compiles on its first use)
        generate(inference_pb2_grpc.InferenceServiceStub(channel), "warm-up", max_tokens=2, content="Hi!")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(traced):
    with grpc.insecure_channel(traced.target) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)


def generate(stub, request_id: str, metadata=(), max_tokens: int = 96, content: str = PROMPT, **sampling) -> list:
    req = pb.GenerateRequest(request_id=request_id,
                             messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=content)]),
                             sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
    return list(stub.Generate(req, metadata=metadata, timeout=120))


def chat(server, request_id: str, headers=None, max_tokens: int = 96) -> tuple[dict, list[dict]]:
    """A streamed chat completion; returns (the usage chunk, the other chunks)."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.7, "top_p": 0.8, "stream": True, "stream_options": {"include_usage": True},
            "request_id": request_id}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, headers=headers or {},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1], chunks[:-1]


def check_call_spans(spans: list, usage_prompt: int, num_cached: int, output_tokens: int):
    """The call's span tree: one SERVER span, its preprocess / queue / prefill / decode children one after the other
    (queue, prefill and decode adding up to the call's duration within 5%), the prefill chunks under prefill.
    Returns (server span, its attributes)."""
    (server,) = [s for s in spans if s.kind == SERVER]
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (pre,), (queue,), (prefill,), (decode,) = by_name["preprocess"], by_name["queue"], by_name["prefill"], \
        by_name["decode"]
    for child in (pre, queue, prefill, decode):
        assert child.parent_span_id == server.span_id and child.kind == INTERNAL, child.name
    chunks = sorted(by_name["prefill_chunk"], key=lambda s: attributes(s)["pagedserve.prefill.chunk"])
    assert all(c.parent_span_id == prefill.span_id for c in chunks)
    computed = [attributes(c)["pagedserve.prefill.tokens"] for c in chunks]
    assert sum(computed) == usage_prompt - num_cached and len(chunks) == math.ceil(sum(computed) / STEP_TOKENS)
    assert all(prefill.start_time_unix_nano <= c.start_time_unix_nano <= c.end_time_unix_nano <=
               prefill.end_time_unix_nano for c in chunks)
    assert server.start_time_unix_nano == pre.start_time_unix_nano and \
        pre.end_time_unix_nano == queue.start_time_unix_nano
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert decode.end_time_unix_nano <= server.end_time_unix_nano

    def duration(s) -> int:
        return s.end_time_unix_nano - s.start_time_unix_nano

    parts = duration(queue) + duration(prefill) + duration(decode)
    assert abs(parts - duration(server)) <= 0.05 * duration(server), (parts, duration(server))
    attrs = attributes(server)
    assert attrs["gen_ai.usage.input_tokens"] == usage_prompt
    assert attrs["gen_ai.usage.output_tokens"] == output_tokens
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == num_cached
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.request.max_tokens"] == output_tokens
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(duration(server) / 1e9, rel=1e-6)
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(duration(queue) / 1e9, rel=1e-3, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_model_prefill"] == pytest.approx(duration(prefill) / 1e9, rel=1e-3)
    assert attrs["gen_ai.latency.time_in_model_decode"] == pytest.approx(duration(decode) / 1e9, rel=1e-3)
    ttft = (prefill.end_time_unix_nano - server.start_time_unix_nano) / 1e9
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(ttft, rel=1e-3)
    (first_token,) = [e for e in server.events if e.name == "first_token"]
    assert first_token.time_unix_nano == decode.start_time_unix_nano
    assert attrs["pagedserve.latency.time_in_detokenize"] > 0
    assert attributes(decode)["pagedserve.decode.steps"] == output_tokens - 1
    return server, attrs


def request_logs(logs: list[dict], request_id: str) -> list[dict]:
    lines = [e for e in logs if e.get("request_id") == request_id]
    assert {"generate_start", "completion_finished"} <= {e["event"] for e in lines}, lines
    return lines


def test_grpc_call_with_traceparent_continues_the_callers_trace(traced, stub, collector):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        responses = generate(stub, "grpc-traced", [("traceparent", traceparent(trace_id, parent)),
                                                    ("tracestate", "vendor=abc")], temperature=0.5, top_p=0.9)
    usage = responses[-1].usage
    spans = collector[0].wait_trace(traced.app.services.tracing, trace_id,
                                    5 + -(-(usage.prompt_tokens - usage.cached_prompt_tokens) // STEP_TOKENS))
    server, attrs = check_call_spans(spans, usage.prompt_tokens, usage.cached_prompt_tokens, 96)
    assert server.parent_span_id.hex() == parent and server.trace_state == "vendor=abc"
    model = traced.app.services.generation_name
    assert server.name == f"chat {model}"
    assert attrs["gen_ai.request.model"] == model and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.temperature"] == 0.5 and attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.request.id"] == "grpc-traced"
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.method"] == "Generate" and attrs["rpc.grpc.status_code"] == 0
    resource = collector[0].resources[collector[0].spans.index(server)]
    assert resource["service.name"] == "pagedserve-under-test"
    assert all(e["trace_id"] == trace_id and e["span_id"] == server.span_id.hex()
               for e in request_logs(logs, "grpc-traced"))


def test_http_stream_with_traceparent_continues_the_callers_trace(traced, stub, collector):
    generate(stub, "warm-prefix", max_tokens=1)   # the prompt's full blocks are cached for the call below
    trace_id, parent = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        usage_chunk, chunks = chat(traced, "http-traced", {"traceparent": traceparent(trace_id, parent)})
    usage = usage_chunk["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    spans = collector[0].wait_trace(traced.app.services.tracing, trace_id,
                                    5 + -(-(usage["prompt_tokens"] - cached) // STEP_TOKENS))
    server, attrs = check_call_spans(spans, usage["prompt_tokens"], cached, 96)
    assert server.parent_span_id.hex() == parent
    assert attrs["http.response.status_code"] == 200 and attrs["url.path"] == "/v1/chat/completions"
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7) and attrs["gen_ai.request.top_p"] == \
        pytest.approx(0.8)
    assert all(e["trace_id"] == trace_id for e in request_logs(logs, "http-traced"))


def test_a_call_without_traceparent_starts_a_new_trace(traced, stub, collector):
    tracing = traced.app.services.tracing
    generate(stub, "grpc-untraced-parent", max_tokens=4)
    chat(traced, "http-untraced-parent", max_tokens=4)
    spans = [collector[0].wait_server_span(tracing, rid) for rid in ("grpc-untraced-parent", "http-untraced-parent")]
    assert all(s.parent_span_id == b"" for s in spans)
    ids = {s.trace_id.hex() for s in spans}
    assert len(ids) == 2 and not ids & {"4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737"}
    assert all(len(collector[0].trace(t)) >= 6 for t in ids)   # each with its children


def test_an_unsampled_parent_exports_nothing_but_logs_its_trace_id(traced, stub, collector):
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        generate(stub, "grpc-unsampled", [("traceparent", traceparent(trace_id, "20f067aa0ba902b9", False))],
                 max_tokens=4)
    generate(stub, "grpc-after-unsampled", max_tokens=4)   # exported after the unsampled call's span would be
    collector[0].wait_server_span(traced.app.services.tracing, "grpc-after-unsampled")
    assert collector[0].trace(trace_id) == []
    assert all(e["trace_id"] == trace_id for e in request_logs(logs, "grpc-unsampled"))


def test_a_refused_call_has_a_span_with_its_status(traced, stub, collector):
    trace_id = "7bf92f3577b34da6a3ce929d0e0e4739"
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, "grpc-refused", [("traceparent", traceparent(trace_id, "30f067aa0ba902ba"))],
                     temperature=-1.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (span,) = collector[0].wait_trace(traced.app.services.tracing, trace_id, 1)
    assert attributes(span)["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert span.status.code != 2   # a caller's error is not the server's (OTLP STATUS_CODE_ERROR = 2)
    (rejected,) = [e for e in logs if e["event"] == "request_rejected"]
    assert rejected["trace_id"] == trace_id


def test_model_info_and_ready_line_say_tracing_is_on(traced, stub, collector):
    info = stub.GetModelInfo(pb.GetModelInfoRequest()).tracing
    assert info.enabled and info.otlp_traces_endpoint == collector[1] and info.protocol == "grpc"
    assert info.sampler == "parentbased_always_on" and info.service_name == "pagedserve-under-test"


@pytest.fixture(scope="module")
def untraced(traced):
    """A server without --otlp-traces-endpoint (the traced one's weights), built while constructing a tracer
    provider or an exporter would fail."""
    import opentelemetry.exporter.otlp.proto.grpc.trace_exporter as grpc_exporter
    import opentelemetry.sdk.trace as sdk_trace

    def refuse(*args, **kwargs):
        raise AssertionError("a tracer provider or exporter was made with tracing off")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sdk_trace, "TracerProvider", refuse)
        mp.setattr(grpc_exporter, "OTLPSpanExporter", refuse)
        cm = server_sharing_model(traced, http_port=free_port(), max_num_batched_tokens=STEP_TOKENS)
        s = cm.__enter__()
    yield s
    cm.__exit__(None, None, None)


def test_tracing_off_creates_and_records_nothing(untraced, collector, monkeypatch):
    from opentelemetry.sdk.trace import Tracer

    from pagedserve.engine.timings import TimingRecorder
    from pagedserve.serving.call_trace import CallTrace

    calls = []
    for cls, name in ((Tracer, "start_span"), (TimingRecorder, "add"), (TimingRecorder, "on_step"),
                      (CallTrace, "__init__")):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    assert untraced.app.services.tracing is None
    trace_id = "8bf92f3577b34da6a3ce929d0e0e473a"
    header = traceparent(trace_id, "40f067aa0ba902bb")
    with grpc.insecure_channel(untraced.target) as channel:
        off_stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            responses = generate(off_stub, "grpc-off", [("traceparent", header)], max_tokens=8)
            chat(untraced, "http-off", {"traceparent": header}, max_tokens=8)
        assert not off_stub.GetModelInfo(pb.GetModelInfoRequest()).tracing.enabled
    assert responses[-1].usage.completion_tokens == 8
    assert calls == []
    assert all("trace_id" not in e for e in request_logs(logs, "grpc-off") + request_logs(logs, "http-off"))
    assert collector[0].trace(trace_id) == []
