"""Fuzzing the live server (issue 10): hypothesis builds raw protobuf requests with random and extreme values
(huge and out-of-range numbers, NaN/inf floats, long and binary-looking strings, empty and oversized repeated
fields, invalid UTF-8 and corrupt bytes on the wire) and sends them through generic gRPC methods, so no client-side
check filters them. Every answer must be OK or a client-error status whose message names the field, never
INTERNAL or UNKNOWN, never a hang; afterwards the server is SERVING and every KV block is free.

Cheap by design (about 2,000 cases in a minute on 2 CPU cores): accepted Generate calls ask for a few tokens (or
are cancelled by the test after a few messages) and finish in the background, many at once, so the engine batches
them; rejections arrive within milliseconds and are checked (and shrunk) at once. A longer run:
``FUZZ_SCALE=10 .venv/bin/python -m pytest tests/e2e/test_fuzz.py`` (10x the examples, random instead of fixed draws).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve import sampling_params as sp
from pagedserve.errors import InvalidInputError
from pagedserve_client import pb
from pagedserve_client.v1 import inference_pb2_grpc
from support import assert_no_blocks_held

pytestmark = pytest.mark.e2e

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
U32, U64, I32 = 2**32 - 1, 2**64 - 1, 2**31 - 1
FLT_MAX = 3.4028234663852886e38   # the largest finite float32
SERVICE = "/pagedserve.v1.InferenceService/"
RPCS = {"Generate": ("unary_stream", pb.GenerateResponse), "Embed": ("unary_unary", pb.EmbedResponse),
        "EmbedStream": ("stream_stream", pb.EmbedResponse), "Tokenize": ("unary_unary", pb.TokenizeResponse),
        "Detokenize": ("unary_unary", pb.DetokenizeResponse), "Abort": ("unary_unary", pb.AbortResponse)}
CLIENT_ERRORS = {"INVALID_ARGUMENT", "ALREADY_EXISTS"}     # the only failures these requests may get
QUICK_S = 0.05          # a rejection normally arrives within this; slower calls finish in the background
MAX_PENDING = 48        # background calls at most (the engine batches them)
CALL_TIMEOUT_S = 90.0   # a call still open after this is a hang
READ_LIMIT = 4          # calls that could run long are cancelled by the test after this many messages
BAD_UTF8 = [b"\xff", b"\xc3", b"a\x80b", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe2\x82"]


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    derandomize=SCALE == 1, suppress_health_check=list(HealthCheck))


def field_paths(descriptor, prefix: str = "") -> set[str]:
    """Every dotted field path and oneof name of a message type: what an error message may start with."""
    out = {prefix + o.name for o in descriptor.oneofs}
    for f in descriptor.fields:
        out.add(prefix + f.name)
        if f.message_type is not None and not f.message_type.GetOptions().map_entry:
            out |= field_paths(f.message_type, f"{prefix}{f.name}.")
    return out


@dataclass
class Outcome:
    code: str                       # the call's final status name
    details: str
    messages: list = field(default_factory=list)
    cancelled_by_test: bool = False


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    embedding_dimension: int


class Fuzzer:
    """Sends raw calls from its own event loop thread. An outcome that arrives within QUICK_S is checked at once
    (so hypothesis shrinks it); a slower call is checked in the background, at most MAX_PENDING of them at a
    time, and :meth:`drain` waits for them and reports their failures with the request that caused each."""

    def __init__(self, target: str, limits: Limits):
        self.limits = limits
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="fuzz-client", daemon=True).start()
        self.channel = self._run(self._open(target))
        self.codes: collections.Counter = collections.Counter()
        self.pending: collections.deque = collections.deque()
        self.failures: list[str] = []

    async def _open(self, target: str):
        big = 64 << 20
        return grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", big),
                                                          ("grpc.max_receive_message_length", big)])

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _call(self, rpc: str, raw, read_limit: int | None) -> Outcome:
        kind, response = RPCS[rpc]
        method = getattr(self.channel, kind)(SERVICE + rpc, response_deserializer=response.FromString)
        if kind == "stream_stream":
            return await self._lock_step(method, raw)
        call = method(raw, timeout=CALL_TIMEOUT_S)
        messages, cancelled = [], False
        try:
            if kind == "unary_unary":
                messages.append(await call)
            else:
                async for msg in call:
                    messages.append(msg)
                    if read_limit is not None and len(messages) >= read_limit and not cancelled:
                        cancelled = call.cancel()   # False: the call had already ended; read the rest
                        if cancelled:
                            break
        except grpc.aio.AioRpcError:
            pass
        return Outcome((await call.code()).name, await call.details() or "", messages, cancelled)

    @staticmethod
    async def _lock_step(method, raws: list[bytes]) -> Outcome:
        """A bidi stream that sends each request only after the previous answer: a server that ends the call on
        an error is then never written to afterwards (a client still writing then may read grpc's own INTERNAL
        "Internal error from Core" instead of the server's status)."""
        call, messages = method(timeout=CALL_TIMEOUT_S), []
        try:
            for raw in raws:
                await call.write(raw)
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                messages.append(msg)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF, "an answer nobody asked for"
        except grpc.aio.AioRpcError:
            pass
        return Outcome((await call.code()).name, await call.details() or "", messages)

    def send(self, rpc: str, raw, check, request, read_limit: int | None = None) -> None:
        """Call ``rpc`` with serialized ``raw`` bytes (a list for EmbedStream); ``check(outcome)`` raises on a bad
        answer. ``request`` describes the call in failure reports."""
        fut = asyncio.run_coroutine_threadsafe(self._call(rpc, raw, read_limit), self.loop)
        try:
            out = fut.result(QUICK_S)
        except concurrent.futures.TimeoutError:
            self.pending.append((fut, check, request))
            while len(self.pending) > MAX_PENDING:
                self._settle(*self.pending.popleft())
            return
        self.codes[out.code] += 1
        check(out)

    def _settle(self, fut, check, request) -> None:
        try:
            out = fut.result(CALL_TIMEOUT_S + 30)
            self.codes[out.code] += 1
            check(out)
        except Exception as exc:  # reported by drain(), with the request
            described = text_format.MessageToString(request, as_one_line=True)[:2000] \
                if hasattr(request, "DESCRIPTOR") else repr(request)[:2000]
            self.failures.append(f"{described}\n    -> {exc!r}")

    def drain(self) -> None:
        while self.pending:
            self._settle(*self.pending.popleft())
        failures, self.failures = self.failures, []
        assert not failures, f"{len(failures)} failing calls, e.g.:\n" + "\n".join(failures[:5])

    def close(self) -> None:
        self._run(self.channel.close(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)


# ------------------------------------------------------------------------------------------------- the checks

PATHS = {name: field_paths(getattr(pb, name + "Request").DESCRIPTOR)
         for name in ("Generate", "Embed", "Tokenize", "Detokenize", "Abort")}


def check_status(out: Outcome, paths: set[str]) -> None:
    """OK, our own cancel, or a client error whose message starts with a request field's path."""
    if out.code == "OK" or (out.code == "CANCELLED" and out.cancelled_by_test):
        return
    assert out.code in CLIENT_ERRORS, f"{out.code}: {out.details}"
    named = re.sub(r"\[\d+\]", "", out.details.split(": ", 1)[0])
    assert named in paths, f"{out.code} names no request field: {out.details!r}"


def check_generate(req: pb.GenerateRequest, out: Outcome, limits: Limits) -> None:
    check_status(out, PATHS["Generate"])
    s, msgs = req.sampling, out.messages
    n = s.n if s.HasField("n") else 1
    assert all(0 <= m.index < n for m in msgs)
    assert len({m.request_id for m in msgs}) <= 1 and all(m.request_id for m in msgs)
    assert not req.request_id or all(m.request_id == req.request_id for m in msgs)
    assert all(t < limits.vocab_size for m in msgs for t in m.token_ids)
    if out.code != "OK":
        return
    by_index = collections.defaultdict(list)
    for m in msgs:
        by_index[m.index].append(m)
    assert sorted(by_index) == list(range(n)), "a completion never reported"
    for completion in by_index.values():
        check_completion(completion, s)
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)


def check_completion(msgs: list, s: pb.SamplingParams) -> None:
    reasons = [m.finish_reason for m in msgs]
    assert reasons[-1] in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) and not any(reasons[:-1]), reasons
    num_tokens = sum(len(m.token_ids) for m in msgs)
    if s.HasField("max_tokens"):
        assert num_tokens <= s.max_tokens
        assert reasons[-1] != pb.FINISH_REASON_LENGTH or num_tokens == s.max_tokens
    text = "".join(m.text for m in msgs)
    assert s.include_stop_str_in_output or not [x for x in s.stop if x in text], (text, list(s.stop))
    if s.HasField("logprobs"):
        for m in msgs:
            assert len(m.logprobs) == len(m.token_ids)
            assert all(len(lp.top_logprobs) == s.logprobs for lp in m.logprobs)


def check_embed(req: pb.EmbedRequest, out: Outcome, limits: Limits, stream_index: int = 0) -> None:
    check_status(out, PATHS["Embed"])
    if out.code != "OK":
        return
    resp = out.messages[0]
    assert (resp.request_id, resp.stream_index) == (req.request_id, stream_index)
    dim = req.dimensions if req.HasField("dimensions") else limits.embedding_dimension
    assert len(resp.embeddings) == len(req.inputs) and resp.usage.prompt_tokens > 0
    for e in resp.embeddings:
        assert len(e.values) == dim and all(math.isfinite(v) for v in e.values)
        if not req.HasField("normalize") or req.normalize:
            assert abs(math.sqrt(sum(v * v for v in e.values)) - 1) < 1e-3


def check_tokenize(out: Outcome, limits: Limits) -> None:
    check_status(out, PATHS["Tokenize"])
    if out.code == "OK":
        resp = out.messages[0]
        assert len(resp.tokens) == len(resp.token_ids) and all(t < limits.vocab_size for t in resp.token_ids)


# --------------------------------------------------------------------------------------------- the strategies

def texts(max_size: int = 24, min_size: int = 0):
    return st.text(st.characters(codec="utf-8"), min_size=min_size, max_size=max_size)


BINARYISH = st.binary(max_size=12).map(lambda b: b.decode("latin-1"))   # NULs, control and high-Latin-1 chars


def floats32(*special: float):
    return st.one_of(st.floats(width=32), st.sampled_from(special))


def any_token_id(limits: Limits):
    return st.one_of(st.integers(0, 300), st.integers(0, U32), st.sampled_from([limits.vocab_size - 1,
                                                                               limits.vocab_size, U32]))


def any_sampling(limits: Limits):
    """Every field set or not, each with in-range, boundary and out-of-range values."""
    ids, L, K = any_token_id(limits), limits.max_model_len, limits.max_logprobs
    penalty = floats32(-2.0, 2.0, -2.001, 2.001, 0.0)
    return st.fixed_dictionaries({}, optional={
        "max_tokens": st.one_of(st.integers(1, 3), st.sampled_from([0, L, 100_000, U32])),
        "min_tokens": st.sampled_from([0, 1, 2, 5, U32]),
        "temperature": floats32(0.0, -0.0, 1e-6, 1e-5, 0.7, 1e30, -1.0),
        "top_p": floats32(0.0, 1e-9, 0.5, 1.0, 1.0000001),
        "top_k": st.sampled_from([0, 1, 2, 50, limits.vocab_size, limits.vocab_size + 1, U32]),
        "min_p": floats32(0.0, 0.5, 1.0, 1.5, -0.1),
        "seed": st.integers(0, U64),
        "presence_penalty": penalty, "frequency_penalty": penalty,
        "repetition_penalty": floats32(0.0, -1.0, 1e-30, 1.0, 2.0, 1e30),
        "stop": st.one_of(st.lists(texts(8), max_size=3), st.just(["x"] * (sp.MAX_STOP_STRINGS + 1)),
                          st.just(["y" * (sp.MAX_STOP_STRING_CHARS + 1)])),
        "stop_token_ids": st.one_of(st.lists(ids, max_size=4), st.just(list(range(sp.MAX_STOP_TOKEN_IDS + 1)))),
        "include_stop_str_in_output": st.booleans(), "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "n": st.sampled_from([0, 1, 2, 3, sp.MAX_N + 1, U32]),
        "logprobs": st.sampled_from([0, 1, 5, K, K + 1, U32]),
        "prompt_logprobs": st.sampled_from([0, 1, K, K + 1, U32]),
        "logit_bias": st.one_of(st.dictionaries(ids, st.floats(width=32), max_size=3),
                                st.just(dict.fromkeys(range(sp.MAX_LOGIT_BIAS_ENTRIES + 1), 1.0))),
        "truncate_prompt_tokens": st.sampled_from([0, 1, 4, U32]),
    })


def valid_sampling(limits: Limits):
    """Only in-range values, extremes included (huge temperatures and penalties, subnormals, huge top_k ...);
    max_tokens 1..2 and n 1..2 so each request stays cheap."""
    V, K = limits.vocab_size, limits.max_logprobs
    return st.fixed_dictionaries({"max_tokens": st.integers(1, 2)}, optional={
        "min_tokens": st.integers(0, 1),
        "temperature": st.one_of(st.floats(0, FLT_MAX, width=32), st.sampled_from([0.0, 1e-6, 1e-5])),
        "top_p": st.floats(0, 1, exclude_min=True, width=32),
        "top_k": st.integers(0, U32),
        "min_p": st.floats(0, 1, width=32),
        "seed": st.integers(0, U64),
        "presence_penalty": st.floats(-2, 2, width=32), "frequency_penalty": st.floats(-2, 2, width=32),
        "repetition_penalty": st.floats(0, FLT_MAX, exclude_min=True, width=32),
        "stop": st.lists(st.one_of(texts(6, 1), texts(sp.MAX_STOP_STRING_CHARS, 1)), max_size=sp.MAX_STOP_STRINGS),
        "stop_token_ids": st.lists(st.integers(0, V - 1), max_size=8),
        "include_stop_str_in_output": st.booleans(), "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "n": st.integers(1, 2),
        "logprobs": st.integers(0, K), "prompt_logprobs": st.integers(0, K),
        "logit_bias": st.dictionaries(st.integers(0, V - 1), st.floats(-sp.MAX_ABS_LOGIT_BIAS,
                                                                      sp.MAX_ABS_LOGIT_BIAS, width=32), max_size=4),
        "truncate_prompt_tokens": st.integers(1, U32),
    })


def chat(role, content, max_size: int = 3, min_size: int = 0):
    return st.lists(st.tuples(role, content), min_size=min_size, max_size=max_size)


def inputs(limits: Limits, valid: bool):
    """("prompt", text) | ("ids", token ids) | ("messages", [(role, content)]) | None (no input)."""
    L = limits.max_model_len
    if valid:
        prompt = st.tuples(st.just("prompt"), texts(8, 1))
        ids = st.tuples(st.just("ids"), st.lists(st.integers(0, limits.vocab_size - 1), min_size=1, max_size=8))
        # A chat starts with its own short system message: the template's default one is ~30 tokens.
        messages = st.tuples(st.just("messages"), st.builds(lambda system, rest: [("system", system)] + rest,
                                                            texts(8), chat(st.sampled_from(["user", "assistant"]),
                                                                           texts(8), 1)))
        return st.one_of(prompt, ids, prompt, ids, messages)   # short prompts: prefill is the main cost
    too_long = st.integers(1, 3).map(lambda k: "7" * (k * L))   # one token per digit: past max_model_len
    return st.one_of(
        st.none(),
        st.tuples(st.just("prompt"), st.one_of(texts(12), BINARYISH, too_long)),
        st.tuples(st.just("ids"), st.one_of(st.lists(any_token_id(limits), max_size=8),
                                            st.integers(L, 2 * L).map(lambda k: [7] * k))),
        st.tuples(st.just("messages"), chat(st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]),
                                                      texts(6)), st.one_of(texts(8), BINARYISH), 1)))


def build_generate(request_id, input, sampling, priority, cache_salt) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, priority=priority, cache_salt=cache_salt)
    if input is not None:
        kind, value = input
        if kind == "prompt":
            req.prompt = value
        elif kind == "ids":
            req.prompt_token_ids.SetInParent()
            req.prompt_token_ids.ids.extend(value)
        else:
            req.messages.SetInParent()
            req.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in value)
    if sampling is not None:
        req.sampling.CopyFrom(pb.SamplingParams(**sampling))
    return req


def generate_requests(limits: Limits, valid: bool):
    return st.builds(build_generate, request_id=st.just("") if valid else st.one_of(st.just(""), texts(12)),
                     input=inputs(limits, valid),
                     sampling=valid_sampling(limits) if valid else st.one_of(st.none(), any_sampling(limits)),
                     priority=st.integers(-2**31, I32),
                     cache_salt=st.one_of(st.just(""), texts(12).filter(str.isprintable) if valid else texts(12)))


def embed_requests(limits: Limits):
    D = limits.embedding_dimension

    def build(inputs, normalize, truncate, dimensions, request_id):
        req = pb.EmbedRequest(inputs=inputs, request_id=request_id)
        for name, value in (("normalize", normalize), ("truncate", truncate), ("dimensions", dimensions)):
            if value is not None:
                setattr(req, name, value)
        return req

    maybe_bool = st.one_of(st.none(), st.booleans())
    return st.builds(build, inputs=st.one_of(st.lists(st.one_of(texts(40), BINARYISH), max_size=4),
                                             st.just(["a"] * 129), st.just(["7" * 2000])),
                     normalize=maybe_bool, truncate=maybe_bool,
                     dimensions=st.one_of(st.none(), st.sampled_from([0, 1, 2, D - 1, D, D + 1, U32])),
                     request_id=st.one_of(st.just(""), texts(12)))


# ------------------------------------------------------------------------------------------ wire-level bytes

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    tag = _varint(number << 3 | wire_type)
    return tag + (_varint(len(payload)) + payload if wire_type == 2 else payload)


# Appended fields override (scalars, oneof) or merge into (messages) what the base message has.
_BAD_UTF8_AT = {"prompt": lambda b: _field(2, 2, b), "request_id": lambda b: _field(1, 2, b),
                "cache_salt": lambda b: _field(7, 2, b), "sampling.stop": lambda b: _field(5, 2, _field(11, 2, b)),
                "messages.role": lambda b: _field(4, 2, _field(1, 2, _field(1, 2, b)))}
MUTATIONS = st.one_of(
    st.tuples(st.just("bad_utf8"), st.sampled_from(sorted(_BAD_UTF8_AT)), st.sampled_from(BAD_UTF8)),
    st.tuples(st.just("truncate"), st.integers(0, 4096)),
    st.tuples(st.just("flip"), st.integers(0, 4096), st.integers(0, 7)),
    st.tuples(st.just("append"), st.binary(max_size=24)),
    st.tuples(st.just("varint"), st.sampled_from([1, 2, 5, 15, 16, 20]), st.integers(0, U64)),  # sampling uint32s
)


def mutate(raw: bytes, mutation: tuple) -> bytes:
    kind = mutation[0]
    if kind == "bad_utf8":
        return raw + _BAD_UTF8_AT[mutation[1]](mutation[2])
    if kind == "truncate":
        return raw[:mutation[1] % (len(raw) + 1)]
    if kind == "flip":
        if not raw:
            return raw
        pos = mutation[1] % len(raw)
        return raw[:pos] + bytes([raw[pos] ^ (1 << mutation[2])]) + raw[pos + 1:]
    if kind == "append":
        return raw + mutation[1]
    return raw + _field(5, 2, _field(mutation[1], 0, _varint(mutation[2])))


def check_malformed(out: Outcome) -> None:
    assert out.code == "INVALID_ARGUMENT", f"a message that does not parse got {out.code}: {out.details}"


# ------------------------------------------------------------------------------- limits and malformed messages

def _unary(channel, rpc: str, response):
    return channel.unary_unary(SERVICE + rpc, response_deserializer=response.FromString)


def _generate(channel, req: pb.GenerateRequest, first_only: bool = False) -> tuple[str, str]:
    """(status name, details) of a Generate call; ``first_only`` cancels it after the first message."""
    call = channel.unary_stream(SERVICE + "Generate", response_deserializer=pb.GenerateResponse.FromString)(
        req.SerializeToString(), timeout=120)
    try:
        for _ in call:
            if first_only:
                call.cancel()
                return "OK", ""
    except grpc.RpcError:
        pass
    return call.code().name, call.details() or ""


def limit_cases(max_logprobs: int, max_model_len: int) -> list[tuple[str, dict, dict]]:
    """(field, sampling at the limit, sampling past it) for every documented per-request limit."""
    return [
        ("sampling.n", {"n": sp.MAX_N}, {"n": sp.MAX_N + 1}),
        ("sampling.stop", {"stop": ["s"] * sp.MAX_STOP_STRINGS}, {"stop": ["s"] * (sp.MAX_STOP_STRINGS + 1)}),
        ("sampling.stop", {"stop": ["s" * sp.MAX_STOP_STRING_CHARS]}, {"stop": ["s" * (sp.MAX_STOP_STRING_CHARS + 1)]}),
        ("sampling.stop_token_ids", {"stop_token_ids": list(range(sp.MAX_STOP_TOKEN_IDS))},
         {"stop_token_ids": list(range(sp.MAX_STOP_TOKEN_IDS + 1))}),
        ("sampling.logit_bias", {"logit_bias": dict.fromkeys(range(sp.MAX_LOGIT_BIAS_ENTRIES), 0.5)},
         {"logit_bias": dict.fromkeys(range(sp.MAX_LOGIT_BIAS_ENTRIES + 1), 0.5)}),
        ("sampling.logprobs", {"logprobs": max_logprobs}, {"logprobs": max_logprobs + 1}),
        ("sampling.prompt_logprobs", {"prompt_logprobs": max_logprobs}, {"prompt_logprobs": max_logprobs + 1}),
        ("sampling.max_tokens", {"max_tokens": max_model_len - 2}, {"max_tokens": max_model_len - 1}),  # 2-token prompt
    ]


def test_resource_limits_are_enforced_with_invalid_argument(server):
    """At each documented limit a request is served; one past it is INVALID_ARGUMENT naming the field. The prompt
    is bounded by max_model_len, the whole message by max_receive_message_bytes (RESOURCE_EXHAUSTED from gRPC)."""
    engine = server.engine
    prompt = pb.TokenIds(ids=[1000, 1001])
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as channel:
        for name, at_limit, past in limit_cases(engine.config.max_logprobs, engine.max_model_len):
            ok = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**{"max_tokens": 1,
                                                                                           **at_limit}))
            assert _generate(channel, ok, first_only="max_tokens" in at_limit) == ("OK", ""), name
            bad = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**{"max_tokens": 1,
                                                                                            **past}))
            code, details = _generate(channel, bad)
            assert code == "INVALID_ARGUMENT" and details.startswith(name + ": "), (name, code, details)
        code, details = _generate(channel, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(
            ids=[7] * engine.max_model_len), sampling=pb.SamplingParams(max_tokens=1)))
        assert code == "INVALID_ARGUMENT" and details.startswith("prompt: "), details
        too_big = "a" * (server.app.server_config.max_receive_message_bytes + 1)
        code, details = _generate(channel, pb.GenerateRequest(prompt=too_big))
        assert code == "RESOURCE_EXHAUSTED" and "Received message larger than max" in details, (code, details)
    assert_no_blocks_held(server)


@pytest.mark.parametrize("field, kwargs", [(f, past) for f, _, past in limit_cases(20, 100)[:5]])
def test_sampling_params_limits(field, kwargs):
    with pytest.raises(InvalidInputError) as err:
        sp.SamplingParams(**kwargs)
    assert err.value.field == field


MALFORMED = [
    ("Generate", _field(2, 2, b"\xff\xfe")),                                  # prompt: invalid UTF-8
    ("Generate", _field(5, 2, _field(11, 2, b"\xc3"))),                        # sampling.stop: truncated character
    ("Generate", b"\x12\x10ab"),                                              # prompt: length past the end
    ("Tokenize", _field(1, 2, b"a\x80b")),                                     # text: invalid UTF-8
    ("Embed", _field(1, 2, b"\xed\xa0\x80")),                                  # inputs: an encoded surrogate
    ("EmbedStream", [_field(1, 2, b"ok"), _field(1, 2, b"\xff")]),            # the second request
    ("Abort", _field(1, 2, b"\xc0\xaf")),                                     # request_ids: overlong encoding
]


@pytest.mark.parametrize("rpc, raw", MALFORMED, ids=[f"{r}-{i}" for i, (r, _) in enumerate(MALFORMED)])
def test_malformed_messages_are_invalid_argument(fuzz, rpc, raw):
    """Proto3 strings must be UTF-8, so the server cannot parse these: that is the client's error (the grpc
    library's own answer to a request it cannot deserialize is UNKNOWN)."""
    out = fuzz._run(fuzz._call(rpc, raw, None), CALL_TIMEOUT_S + 10)
    assert out.code == "INVALID_ARGUMENT", f"{out.code}: {out.details}"


def test_request_ids_like_a_completion_index_do_not_collide(server):
    """n > 1 completions run as "<id>#<i>" inside the engine; a client's own "<id>#1" must stay separate."""
    base = "collide-" + os.urandom(4).hex()
    a = pb.GenerateRequest(request_id=base, prompt_token_ids=pb.TokenIds(ids=list(range(1000, 1010))),
                           sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2))
    b = pb.GenerateRequest(request_id=base + "#1", prompt_token_ids=pb.TokenIds(ids=list(range(3000, 3005))),
                           sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))

    def run(reqs):
        with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool, grpc.insecure_channel(server.target) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            return list(pool.map(lambda r: _tokens_by_index(stub, r), reqs))
    alone = run([a]) + run([b])
    together = run([a, b])
    assert together == alone
    assert_no_blocks_held(server)


def _tokens_by_index(stub, req) -> tuple[str, dict]:
    """(status, {index: (token ids, text)}) of one Generate call."""
    out: dict = collections.defaultdict(lambda: ([], []))
    try:
        for msg in stub.Generate(req, timeout=120):
            out[msg.index][0].extend(msg.token_ids)
            out[msg.index][1].append(msg.text)
    except grpc.RpcError as err:
        return err.code().name + ": " + err.details(), {}
    return "OK", {i: (ids, "".join(text)) for i, (ids, text) in out.items()}


def test_a_huge_prompt_does_not_stall_other_calls(server):
    """Tokenizing a multi-megabyte prompt takes seconds; it must not block the event loop that serves every
    other call (here: health checks, answered in milliseconds when the loop is free). With truncate_prompt_tokens
    the prompt is tokenized in full (its last tokens are kept); without, it would be refused from its length."""
    prompt = "hello world " * 300_000          # 3.6 MB, 600 k tokens
    with grpc.insecure_channel(server.target) as channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
        health = health_pb2_grpc.HealthStub(channel)
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        started = time.monotonic()
        call = pool.submit(_generate, channel, pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=1, truncate_prompt_tokens=8)))
        worst = 0.0
        while not call.done():
            start = time.monotonic()
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.01)
        took = time.monotonic() - started
        assert call.result()[0] == "OK"
    # Blocked, a health check waits about as long as the whole call (the tokenizing); served, milliseconds.
    assert worst < max(0.2, took / 4), f"a health check waited {worst:.2f} s of the call's {took:.2f} s"


# -------------------------------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def fuzz(server):
    with grpc.insecure_channel(server.target) as channel:
        info = model_info(channel)
    limits = Limits(info.generation.vocab_size, info.generation.max_model_len, server.engine.config.max_logprobs,
                    info.embedding.embedding_dimension)
    f = Fuzzer(server.target, limits)
    yield f
    f.close()


def model_info(channel) -> pb.GetModelInfoResponse:
    return _unary(channel, "GetModelInfo", pb.GetModelInfoResponse)(
        pb.GetModelInfoRequest().SerializeToString(), timeout=30)


def send_generate(fuzz: Fuzzer, req: pb.GenerateRequest, raw: bytes | None = None) -> None:
    s = req.sampling
    long = not s.HasField("max_tokens") or s.max_tokens > 8
    fuzz.send("Generate", req.SerializeToString() if raw is None else raw,
              lambda out: check_generate(req, out, fuzz.limits), req, READ_LIMIT if long else None)


def run_fuzz(fuzz: Fuzzer, examples: int, strategy, body) -> None:
    @fuzz_settings(examples)
    @given(strategy)
    def run(case):
        body(case)

    try:
        run()
    finally:
        fuzz.drain()


def test_fuzz_generate_any_values(fuzz):
    run_fuzz(fuzz, 600, generate_requests(fuzz.limits, valid=False), lambda req: send_generate(fuzz, req))


def test_fuzz_generate_extreme_valid_values_succeed(fuzz):
    """In-range values only, however extreme: every request must be served (OK, never rejected)."""
    def body(req):
        def check(out):
            _assert_ok(out)
            check_generate(req, out, fuzz.limits)
        fuzz.send("Generate", req.SerializeToString(), check, req)
    run_fuzz(fuzz, 100, generate_requests(fuzz.limits, valid=True), body)


def _assert_ok(out: Outcome) -> None:
    assert out.code == "OK", f"a valid request got {out.code}: {out.details}"


def test_fuzz_generate_wire_bytes(fuzz):
    def body(case):
        req, mutation = case
        raw = mutate(req.SerializeToString(), mutation)
        try:
            parsed = pb.GenerateRequest.FromString(raw)
        except DecodeError:
            fuzz.send("Generate", raw, check_malformed, (raw, mutation))
            return
        send_generate(fuzz, parsed, raw)
    run_fuzz(fuzz, 120, st.tuples(generate_requests(fuzz.limits, valid=True), MUTATIONS), body)


def test_fuzz_embed(fuzz):
    def body(req):
        fuzz.send("Embed", req.SerializeToString(), lambda out: check_embed(req, out, fuzz.limits), req)
    run_fuzz(fuzz, 200, embed_requests(fuzz.limits), body)


def test_fuzz_embed_stream(fuzz):
    def check(reqs, out):
        check_status(out, PATHS["Embed"])
        assert out.code != "OK" or len(out.messages) == len(reqs)
        for i, (req, resp) in enumerate(zip(reqs, out.messages)):
            check_embed(req, Outcome("OK", "", [resp]), fuzz.limits, i)

    def body(reqs):
        fuzz.send("EmbedStream", [r.SerializeToString() for r in reqs], lambda out: check(reqs, out), reqs)
    run_fuzz(fuzz, 40, st.lists(embed_requests(fuzz.limits), max_size=3), body)


def test_fuzz_tokenize(fuzz):
    def build(input, add_special_tokens, add_generation_prompt):
        req = pb.TokenizeRequest()
        if input is not None and input[0] == "prompt":
            req.text = input[1]
        elif input is not None and input[0] == "messages":
            req.messages.SetInParent()
            req.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in input[1])
        for name, value in (("add_special_tokens", add_special_tokens),
                            ("add_generation_prompt", add_generation_prompt)):
            if value is not None:
                setattr(req, name, value)
        return req

    maybe_bool = st.one_of(st.none(), st.booleans())
    strategy = st.builds(build, inputs(fuzz.limits, valid=False), maybe_bool, maybe_bool)
    run_fuzz(fuzz, 350, strategy, lambda req: fuzz.send("Tokenize", req.SerializeToString(),
                                                        lambda out: check_tokenize(out, fuzz.limits), req))


def test_fuzz_detokenize_and_abort(fuzz):
    def body(case):
        ids, skip, abort_ids = case
        req = pb.DetokenizeRequest(token_ids=ids)
        if skip is not None:
            req.skip_special_tokens = skip
        fuzz.send("Detokenize", req.SerializeToString(), lambda out: check_status(out, PATHS["Detokenize"]), req)
        abort = pb.AbortRequest(request_ids=abort_ids)
        fuzz.send("Abort", abort.SerializeToString(), lambda out: _assert_ok(out), abort)
    strategy = st.tuples(st.lists(any_token_id(fuzz.limits), max_size=16), st.one_of(st.none(), st.booleans()),
                         st.lists(st.one_of(texts(12), BINARYISH), max_size=4))
    run_fuzz(fuzz, 300, strategy, body)


def test_after_fuzzing_the_server_is_serving_and_every_block_is_free(server, fuzz):
    fuzz.drain()
    assert_no_blocks_held(server)
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pagedserve.v1.InferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service
        kv = model_info(channel).kv_cache
    assert kv.num_blocks_free == kv.num_blocks_total, kv
    assert kv.num_requests_running == 0 and kv.num_requests_waiting == 0 and server.app.services.generation.engine.dead is None
    print(f"\nfuzz: {sum(fuzz.codes.values())} calls, outcomes {dict(fuzz.codes)}, "
          f"blocks free {kv.num_blocks_free}/{kv.num_blocks_total}")
