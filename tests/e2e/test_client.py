"""pagedserve_client (sync, asyncio) and the `pagedserve-client` CLI end to end against an in-process fake server.

FakeInferenceServicer is a test double: it records every request it receives and answers with canned data, so
these tests check the client's wire behaviour (fields and presence, streaming, errors, retries, deadlines), not
the engine.
"""
from __future__ import annotations

import asyncio
import collections
import io
import json
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve_client import AsyncPagedServeClient, PagedServeClient, cli
from pagedserve_client.v1 import inference_pb2 as pb
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

DELTAS = ["Hel", "lo", " wörld 🌍"]
FULL_TEXT = "".join(DELTAS)


class FakeInferenceServicer(pb_grpc.InferenceServiceServicer):
    """Test double of InferenceService: records requests, fails on demand, streams canned deltas."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: dict[str, list] = collections.defaultdict(list)
        self.metadata: dict[str, list[dict]] = collections.defaultdict(list)   # each call's invocation metadata
        self.fail_next: collections.Counter = collections.Counter()  # method -> UNAVAILABLE answers to give
        self.first_delta_flushed = threading.Event()  # set by the test's stdout when "Hel" is flushed
        self.saw_flush: bool | None = None
        self.cancelled = threading.Event()

    def _enter(self, method: str, request, context) -> None:
        self.requests[method].append(request)
        self.metadata[method].append(dict(context.invocation_metadata()))
        if self.fail_next[method] > 0:
            self.fail_next[method] -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake: try again")

    def Generate(self, request, context):
        self._enter("Generate", request, context)
        if request.prompt == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0")
        if request.prompt in ("slow", "endless"):
            context.add_callback(self.cancelled.set)
            deadline = time.monotonic() + 10
            while context.is_active() and time.monotonic() < deadline:
                yield pb.GenerateResponse(request_id="r1", text=".")
                time.sleep(0.02)
            return
        n = request.sampling.n if request.sampling.HasField("n") else 1
        for step, delta in enumerate(DELTAS):
            for index in range(n):
                last = step == len(DELTAS) - 1
                response = pb.GenerateResponse(request_id=request.request_id or "r1", index=index, text=delta,
                                               token_ids=[step])
                if last:
                    response.finish_reason = pb.FINISH_REASON_STOP
                    response.matched_stop_str = "###"
                    if index == n - 1:
                        response.usage.prompt_tokens, response.usage.completion_tokens = 4, len(DELTAS) * n
                yield response
            if request.prompt == "wait-flush" and step == 0:
                self.saw_flush = self.first_delta_flushed.wait(timeout=5)

    def Embed(self, request, context):
        self._enter("Embed", request, context)
        embeddings = [pb.Embedding(values=[float(len(text)), 0.5]) for text in request.inputs]
        return pb.EmbedResponse(embeddings=embeddings, usage=pb.EmbedUsage(prompt_tokens=7))

    def Tokenize(self, request, context):
        self._enter("Tokenize", request, context)
        text = request.text if request.WhichOneof("input") == "text" else "|".join(
            m.content for m in request.messages.messages)
        return pb.TokenizeResponse(token_ids=[ord(c) for c in text], tokens=list(text))

    def Detokenize(self, request, context):
        self._enter("Detokenize", request, context)
        return pb.DetokenizeResponse(text="".join(chr(i) for i in request.token_ids))

    def Rerank(self, request, context):
        self._enter("Rerank", request, context)
        order = sorted(range(len(request.texts)), key=lambda i: -len(request.texts[i]))
        if request.HasField("top_n"):
            order = order[:request.top_n]
        results = [pb.RerankResult(index=i, score=len(request.texts[i]),
                                   **({"text": request.texts[i]} if request.return_text else {})) for i in order]
        return pb.RerankResponse(results=results, usage=pb.EmbedUsage(prompt_tokens=5))

    def Score(self, request, context):
        self._enter("Score", request, context)
        return pb.ScoreResponse(scores=[len(a) * len(b) for a, b in zip(
            list(request.text_1) * len(request.text_2) if len(request.text_1) == 1 else request.text_1,
            request.text_2)])

    def GetModelInfo(self, request, context):
        self._enter("GetModelInfo", request, context)
        return pb.GetModelInfoResponse(generation=pb.GenerationModelInfo(name="fake-llm", block_size=16))

    def Abort(self, request, context):
        self._enter("Abort", request, context)
        return pb.AbortResponse(aborted_request_ids=[i for i in request.request_ids if i.startswith("live")])


@pytest.fixture(scope="module")
def server():
    fake = FakeInferenceServicer()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_InferenceServiceServicer_to_server(fake, grpc_server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("pagedserve.v1.InferenceService", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", fake
    grpc_server.stop(grace=None)


@pytest.fixture
def target(server):
    address, fake = server
    fake.reset()
    return address


@pytest.fixture
def fake(server):
    return server[1]


def run_cli(target: str, *argv: str, capsys) -> tuple[int, str, str]:
    code = cli.main(["--target", target, *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- sync client ----------------------------------------------------------------------------------------------

def test_generate_streams_in_order_and_generate_text_joins(target, fake):
    with PagedServeClient(target, timeout_s=10) as client:
        responses = list(client.generate("hi", max_tokens=8, temperature=0.0))
        result = client.generate_text(messages=[("system", "s"), {"role": "user", "content": "u"}], seed=0)
    assert [r.text for r in responses] == DELTAS
    assert result.text == FULL_TEXT and result.finish_reason == "STOP"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (4, 3)
    first, second = fake.requests["Generate"]
    assert first.prompt == "hi" and first.sampling.max_tokens == 8
    assert first.sampling.HasField("temperature") and first.sampling.temperature == 0.0
    assert not first.sampling.HasField("top_p") and not first.sampling.HasField("seed")
    assert second.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in second.messages.messages] == [("system", "s"), ("user", "u")]
    assert second.sampling.HasField("seed") and second.sampling.seed == 0


def test_generate_input_checks_happen_before_any_call(target, fake):
    with PagedServeClient(target) as client:
        with pytest.raises(ValueError, match="exactly one"):
            client.generate("a", prompt_token_ids=[1, 2])
        with pytest.raises(ValueError, match="exactly one"):
            client.generate()
        with pytest.raises(TypeError):
            client.generate("a", temprature=0.5)
        with pytest.raises(ValueError, match="n == 1"):
            client.generate_text("a", n=2)
        client.generate("", prompt_token_ids=None).close()
    assert len(fake.requests["Generate"]) <= 1  # only the empty-prompt call may reach the server


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_generate_sends_the_calls_metadata_after_the_api_key(target, fake):
    with PagedServeClient(target, timeout_s=10, api_key="k1") as client:
        list(client.generate("hi", metadata=[("traceparent", TRACEPARENT), ("x-caller", "team-a")]))
        client.generate_text("hi", metadata=(("tracestate", "vendor=1"),))
        list(client.generate("hi"))
        for bad, match in (([("TraceParent", "x")], "lower-case"), ([("x-n", 3)], "must be a string"),
                           (["traceparent"], "pairs")):
            with pytest.raises(ValueError, match=match):
                client.generate("hi", metadata=bad)

    async def aio():
        async with AsyncPagedServeClient(target, timeout_s=10) as client:
            async for _ in client.generate("hi", metadata=[("traceparent", TRACEPARENT)]):
                pass

    asyncio.run(aio())
    first, second, third, fourth = fake.metadata["Generate"]   # the refused metadata never reached the server
    assert first["traceparent"] == TRACEPARENT and first["x-caller"] == "team-a"
    assert first["authorization"] == "Bearer k1"
    assert second["tracestate"] == "vendor=1" and second["authorization"] == "Bearer k1"
    assert "traceparent" not in third and third["authorization"] == "Bearer k1"
    assert fourth["traceparent"] == TRACEPARENT and "authorization" not in fourth


def test_unary_methods_and_presence(target, fake):
    with PagedServeClient(target, timeout_s=10) as client:
        embedded = client.embed(["ab", "abcd"], normalize=False, dimensions=0)
        assert [list(e.values) for e in embedded.embeddings] == [[2.0, 0.5], [4.0, 0.5]]
        client.embed("one")
        assert list(client.tokenize("hé").token_ids) == [ord("h"), ord("é")]
        assert client.detokenize([104, 105], skip_special_tokens=False) == "hi"
        assert client.model_info().generation.name == "fake-llm"
        assert client.abort(["live-1", "gone"]) == ["live-1"]
        assert client.abort("live-2") == ["live-2"]
    first, second = fake.requests["Embed"]
    assert first.HasField("normalize") and not first.normalize and first.HasField("dimensions")
    assert not first.HasField("truncate")
    assert list(second.inputs) == ["one"] and not second.HasField("normalize")
    detok = fake.requests["Detokenize"][0]
    assert detok.HasField("skip_special_tokens") and not detok.skip_special_tokens
    assert not fake.requests["Tokenize"][0].HasField("add_special_tokens")


def test_rerank_and_score_sync_async_and_cli(target, fake, capsys):
    with PagedServeClient(target, timeout_s=10) as client:
        ranked = client.rerank("q", ["a", "abc", "ab"], top_n=2, return_text=True)
        assert [(r.index, r.score, r.text) for r in ranked.results] == [(1, 3.0, "abc"), (2, 2.0, "ab")]
        assert client.score("ab", ["a", "abc"]) == [2.0, 6.0]
        assert client.score(["ab", "a"], ["a", "abc"], truncate=True) == [2.0, 3.0]

    async def scenario():
        async with AsyncPagedServeClient(target, timeout_s=10) as client:
            return await client.rerank("q", "xy"), await client.score("abc", "ab")

    ranked_async, scored = asyncio.run(scenario())
    assert [r.index for r in ranked_async.results] == [0] and scored == [6.0]
    first, second = fake.requests["Rerank"]
    assert first.HasField("top_n") and first.return_text and not second.HasField("top_n")
    assert not second.return_text and list(second.texts) == ["xy"] and not second.truncate
    assert [r.truncate for r in fake.requests["Score"]] == [False, True, False]
    code, out, _ = run_cli(target, "rerank", "--query", "q", "a", "abcd", "--top-n", "1", "--truncate",
                           capsys=capsys)
    assert code == 0 and json.loads(out) == {"results": [{"index": 1, "score": 4.0}], "usage": {"prompt_tokens": 5}}
    assert fake.requests["Rerank"][-1].truncate and fake.requests["Rerank"][-1].query == "q"


def test_unary_calls_are_retried_on_unavailable_but_generate_is_not(target, fake):
    with PagedServeClient(target, timeout_s=10) as client:
        fake.fail_next["Tokenize"] = 1
        assert list(client.tokenize("a").token_ids) == [97]
        assert len(fake.requests["Tokenize"]) == 2
        fake.fail_next["Embed"] = 10  # more than maxAttempts (4): the error reaches the caller
        with pytest.raises(grpc.RpcError) as info:
            client.embed("x")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(fake.requests["Embed"]) == 4
        fake.fail_next["Generate"] = 1
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate("hi"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(fake.requests["Generate"]) == 1


def test_deadline_and_early_close_cancel_the_stream(target, fake):
    with PagedServeClient(target, timeout_s=0.3) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate("slow"))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        fake.cancelled.clear()
        stream = client.generate("endless", timeout=None)
        assert next(stream).text == "."
        stream.close()
        assert fake.cancelled.wait(timeout=5)


def test_health(target):
    with PagedServeClient(target) as client:
        assert client.health() == "SERVING"
        assert client.health("pagedserve.v1.InferenceService") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as info:
            client.health("no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# ---- asyncio client -------------------------------------------------------------------------------------------

def test_async_client(target, fake):
    async def scenario():
        async with AsyncPagedServeClient(target, timeout_s=10) as client:
            texts = [r.text async for r in client.generate(prompt_token_ids=[1, 2, 3], top_k=0)]
            result = await client.generate_text("hi")
            fake.fail_next["Detokenize"] = 1
            detok = await client.detokenize([111, 107])
            embedded = await client.embed(["abc"], truncate=True)
            status = await client.health()
            stream = client.generate("endless")
            first = await stream.__anext__()
            await stream.aclose()
            return texts, result, detok, embedded, status, first

    texts, result, detok, embedded, status, first = asyncio.run(scenario())
    assert texts == DELTAS and result.text == FULL_TEXT and result.finish_reason == "STOP"
    assert detok == "ok" and len(fake.requests["Detokenize"]) == 2
    assert list(embedded.embeddings[0].values) == [3.0, 0.5] and fake.requests["Embed"][0].truncate
    assert status == "SERVING" and first.text == "."
    assert fake.cancelled.wait(timeout=5)
    request = fake.requests["Generate"][0]
    assert list(request.prompt_token_ids.ids) == [1, 2, 3]
    assert request.sampling.HasField("top_k") and not request.sampling.HasField("temperature")


# ---- CLI ------------------------------------------------------------------------------------------------------

class FlushRecorder(io.StringIO):
    """stdout stand-in: tells the fake server when the first delta has been flushed."""

    def __init__(self, fake: FakeInferenceServicer) -> None:
        super().__init__()
        self.fake = fake

    def flush(self) -> None:
        if self.getvalue().startswith(DELTAS[0]):
            self.fake.first_delta_flushed.set()


def test_cli_generate_streams_and_flushes_each_delta(target, fake, monkeypatch, capsys):
    recorder = FlushRecorder(fake)
    monkeypatch.setattr(sys, "stdout", recorder)
    assert cli.main(["--target", target, "generate", "wait-flush"]) == 0
    assert fake.saw_flush is True  # the server only sent the rest after the CLI had flushed "Hel"
    assert recorder.getvalue() == FULL_TEXT
    err = capsys.readouterr().err
    assert 'finish_reason=STOP matched_stop="###"' in err
    assert "usage: prompt_tokens=4 completion_tokens=3 cached_prompt_tokens=0" in err


def test_cli_without_sampling_flags_sends_no_sampling_fields(target, fake, capsys):
    assert run_cli(target, "generate", "hi", capsys=capsys)[0] == 0
    request = fake.requests["Generate"][0]
    assert request.sampling.ListFields() == [] and request.prompt == "hi"


def _flag_case(field: str) -> tuple[list[str], object]:
    """argv for one sampling flag with a zero-like value (presence matters), and the value the field must hold."""
    flag, kind = cli.SAMPLING_FLAGS[field]
    if kind is bool:
        return [f"--no-{flag[2:]}"], False
    if kind == "str*":
        return [flag, "a", flag, "b"], ["a", "b"]
    if kind == "int*":
        return [flag, "7", flag, "0"], [7, 0]
    if kind == "bias*":
        return [flag, "5=-1.5", flag, "0=0"], {5: -1.5, 0: 0.0}
    if kind == "json":
        choice = pb.StructuredOutput.Choice(choices=["a", "b"])
        return [flag, '{"choice": ["a", "b"]}'], pb.StructuredOutput(choice=choice)
    return [flag, "0"], 0


@pytest.mark.parametrize("field", list(cli.SAMPLING_FLAGS))
def test_cli_sampling_flag_sets_exactly_its_field(target, fake, capsys, field):
    argv, expected = _flag_case(field)
    assert run_cli(target, "generate", "hi", *argv, capsys=capsys)[0] == 0
    sampling = fake.requests["Generate"][0].sampling
    assert [f.name for f, _ in sampling.ListFields()] == [field]
    value = getattr(sampling, field)
    got = dict(value) if field == "logit_bias" else list(value) if field in ("stop", "stop_token_ids") else value
    assert got == expected


def test_cli_has_a_flag_for_every_sampling_field():
    assert set(cli.SAMPLING_FLAGS) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert cli.SAMPLING_FLAGS["stop_token_ids"][0] == "--stop-token-id"


def test_cli_generate_chat_n_and_json(target, fake, capsys):
    code, out, _ = run_cli(target, "generate", "hello", "--system", "be brief", "--n", "2", "--ignore-eos",
                           capsys=capsys)
    assert code == 0
    assert out == f"--- completion 0 ---\n{FULL_TEXT}\n--- completion 1 ---\n{FULL_TEXT}\n"
    request = fake.requests["Generate"][0]
    assert [(m.role, m.content) for m in request.messages.messages] == [("system", "be brief"), ("user", "hello")]
    assert request.sampling.n == 2 and request.sampling.ignore_eos is True
    code, out, _ = run_cli(target, "generate", "--token-ids", "3", "4", "--json", capsys=capsys)
    lines = [json.loads(line) for line in out.splitlines()]
    assert "".join(line["text"] for line in lines) == FULL_TEXT
    assert lines[-1]["finish_reason"] == "FINISH_REASON_STOP" and lines[0]["index"] == 0
    assert list(fake.requests["Generate"][1].prompt_token_ids.ids) == [3, 4]


def test_cli_errors_exit_1_with_the_status_code(target, fake, capsys):
    code, _, err = run_cli(target, "generate", "fail", capsys=capsys)
    assert code == 1 and err.strip() == "error: INVALID_ARGUMENT: sampling.temperature: must be >= 0"
    code, _, err = run_cli(target, "--timeout", "0.3", "generate", "slow", capsys=capsys)
    assert code == 1 and err.startswith("error: DEADLINE_EXCEEDED:")
    fake.fail_next["Embed"] = 1  # one UNAVAILABLE is retried away
    code, out, _ = run_cli(target, "embed", "ab", "--no-normalize", "--dimensions", "2", capsys=capsys)
    assert code == 0 and json.loads(out) == {"embeddings": [[2.0, 0.5]], "usage": {"prompt_tokens": 7}}
    request = fake.requests["Embed"][-1]
    assert request.HasField("normalize") and not request.normalize and request.dimensions == 2
    assert len(fake.requests["Embed"]) == 2
    code, _, err = run_cli("127.0.0.1:1", "--timeout", "5", "info", capsys=capsys)
    assert code == 1 and err.startswith("error: UNAVAILABLE:")


def test_cli_other_commands(target, fake, capsys):
    assert run_cli(target, "health", capsys=capsys)[:2] == (0, "SERVING\n")
    assert run_cli(target, "health", "--service", "pagedserve.v1.InferenceService", capsys=capsys)[:2] == (
        1, "NOT_SERVING\n")
    assert run_cli(target, "health", "--service", "x", capsys=capsys)[0] == 1
    code, out, _ = run_cli(target, "tokenize", "hi", "--chat", "--no-add-special-tokens", capsys=capsys)
    assert json.loads(out) == {"token_ids": [104, 105], "tokens": ["h", "i"]}
    assert fake.requests["Tokenize"][0].WhichOneof("input") == "messages"
    assert run_cli(target, "detokenize", "104", "105", capsys=capsys)[:2] == (0, "hi\n")
    code, out, _ = run_cli(target, "info", capsys=capsys)
    assert json.loads(out)["generation"]["block_size"] == 16
    code, out, _ = run_cli(target, "abort", "live-9", "dead", capsys=capsys)
    assert json.loads(out) == {"aborted_request_ids": ["live-9"]}


def test_cli_target_from_environment(target, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_TARGET", target)
    assert cli.main(["health"]) == 0


def test_client_imports_neither_torch_nor_the_server_package():
    code = ("import sys, pagedserve_client, pagedserve_client.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pagedserve')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
