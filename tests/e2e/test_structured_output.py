"""Structured output: JSON schema, JSON object, regex, choice and grammar constraints as a token mask.

The sampler-level test drives 1,000 masked steps through the real Sampler with adversarial logits; the end-to-end
tests use the session server (gRPC, and HTTP through the openai SDK) and a small server that must preempt."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
import torch

from support import assert_no_blocks_held, free_port, server_sharing_model

from pagedserve.sample.sampler import Sampler, SamplingRow, make_generator
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutput
from pagedserve.structured_output.bitmask import apply_bitmask_, unpack_allowed
from pagedserve.structured_output.waiting import GrammarWaitList
from pagedserve.errors import InvalidInputError

pytestmark = pytest.mark.e2e

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_min_items": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "enum_number": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10},  # bounded digits
        "ok": {"type": "boolean"}},
        "required": ["colour", "score", "ok"], "additionalProperties": False},
}
PROMPT = "Answer in JSON. A person:"


def _texts(responses) -> dict[int, str]:
    out: dict[int, list[str]] = {}
    finish: dict[int, int] = {}
    for r in responses:
        out.setdefault(r.index, []).append(r.text)
        if r.finish_reason:
            finish[r.index] = r.finish_reason
    return {i: "".join(parts) for i, parts in out.items()}, finish


def _run(client, **kwargs):
    return _texts(list(client.generate(PROMPT, **kwargs)))


# ---- values and pieces (no model) ------------------------------------------------------------------------------
@pytest.mark.parametrize("value,field", [
    ({}, "sampling.structured_output"), ({"regex": "a", "choice": ["a"]}, "sampling.structured_output"),
    ({"json_schema": "{not json"}, "sampling.structured_output.json_schema"),
    ({"json_schema": "[1]"}, "sampling.structured_output.json_schema"),
    ({"choice": []}, "sampling.structured_output.choice"), ({"choice": "ab"}, "sampling.structured_output.choice"),
    ({"grammar": " "}, "sampling.structured_output.grammar"),
    ({"json_object": 1}, "sampling.structured_output.json_object"),
    ({"regex": "a" * 70000}, "sampling.structured_output.regex"), ({"xml": "<a/>"}, "sampling.structured_output"),
])
def test_bad_constraint_values_name_the_field(value, field):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(structured_output=value)
    assert info.value.field == field


def test_constraint_is_hashable_and_keeps_schema_key_order():
    a = StructuredOutput.from_value({"json_schema": {"type": "object", "properties": {"z": {}, "a": {}}}})
    same = StructuredOutput(json_schema=a.json_schema)
    assert a == same and hash(a) == hash(same) and a.field == "sampling.structured_output.json_schema"
    assert a.json_schema.index('"z"') < a.json_schema.index('"a"')
    assert SamplingParams(structured_output={"choice": ["x", "y"]}).structured_output.choice == ("x", "y")


def test_bitmask_unpacks_little_endian_and_sizes_to_the_logits():
    bitmask = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)   # 64 tokens
    allowed = unpack_allowed(bitmask, 70)                                      # logits wider than the mask
    assert allowed.shape == (2, 70)
    assert allowed[0].nonzero().view(-1).tolist() == [0, 2] + list(range(32, 64))
    assert allowed[1].nonzero().view(-1).tolist() == [63]
    logits = torch.zeros(2, 40)                                                # narrower than the mask
    disallowed = apply_bitmask_(logits, bitmask)
    assert logits[0, 0] == 0 and logits[0, 1] == float("-inf") and torch.equal(disallowed, logits.isneginf())


def test_compile_time_limit_fails_the_wait():
    waits = GrammarWaitList(timeout_s=0.0)
    waits.add("group", Future(), "sampling.structured_output.grammar")
    ((key, compiled, error),) = waits.pop_settled()
    assert key == "group" and compiled is None and isinstance(error, InvalidInputError)
    assert error.field == "sampling.structured_output.grammar" and len(waits) == 0


class _RandomMask:
    """A fake matcher: each step a random mask (often a single allowed token), sized below the logits width."""

    def __init__(self, gen: torch.Generator, num_words: int):
        self.gen, self.num_words, self.allowed = gen, num_words, None

    def fill_bitmask(self, row: torch.Tensor) -> None:
        n = self.num_words * 32
        k = 1 if torch.rand(1, generator=self.gen).item() < 0.5 else int(torch.randint(2, 50, (1,), generator=self.gen))
        self.allowed = set(torch.randperm(n, generator=self.gen)[:k].tolist())
        bits = torch.zeros(n, dtype=torch.bool)
        bits[list(self.allowed)] = True
        packed = (bits.view(-1, 32).long() << torch.arange(32)).sum(dim=1)
        row.copy_(torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32))


def test_1000_masked_sampling_steps_never_pick_a_disallowed_token(server):
    """A real JSON-schema grammar (and a fake with single-token masks, logits wider than the mask) under
    adversarial logits that favour disallowed tokens, through every sampling option; the matcher advances."""
    engine = server.engine
    compiled = engine.structured.compiler.compile(StructuredOutput(json_schema=json.dumps(SCHEMAS["enum_number"])))
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=50, seed=3),
              SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                             frequency_penalty=1.0, logit_bias={13: 100.0, 90: 100.0}),
              SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[10])]
    generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
    matchers = [compiled.new_matcher() for _ in params]
    outputs: list[list[int]] = [[] for _ in params]
    width = engine.vocab_size + 64
    steps = 0
    while steps < 1000:
        fake = _RandomMask(gen, 1536)
        logits = torch.randn(len(params) + 1, width, generator=gen) * 5
        logits[:, width - 64:] = 50.0   # past the tokenizer: never allowed
        rows = [SamplingRow(p, [1, 2, 3], outputs[i], generators[i], frozenset({2}), grammar=matchers[i])
                for i, p in enumerate(params)]
        rows.append(SamplingRow(SamplingParams(temperature=1.0), [1], [], None, frozenset({2}), grammar=fake))
        before = [m.llmatcher.deep_copy() for m in matchers]
        out = sampler(logits, rows)
        for i, token in enumerate(out.token_ids[:-1]):
            allowed = unpack_allowed(torch.frombuffer(bytearray(before[i].compute_bitmask()), dtype=torch.int32)
                                     .view(1, -1)[:, :1536], width)[0]
            assert allowed[token], (i, token)
            outputs[i].append(token)
            if token == 2 or (matchers[i].accept(token) or matchers[i].is_terminated()):
                matchers[i], outputs[i] = compiled.new_matcher(), []
        assert out.token_ids[-1] in fake.allowed
        steps += len(out.token_ids)


# ---- end to end over gRPC --------------------------------------------------------------------------------------
def test_json_schemas_20_sampled_completions_each_validate(server, client):
    def one(name):
        texts, finish = _run(client, structured_output={"json_schema": SCHEMAS[name]}, n=20, temperature=1.0,
                             seed=len(name), max_tokens=64)
        return name, texts, finish

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(one, SCHEMAS))
    for name, texts, finish in results:
        assert len(texts) == 20
        for i, text in texts.items():
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            assert finish[i] == 1, (name, text)   # STOP: the grammar completed (or EOS where it may end)
    assert_no_blocks_held(server)


def test_regex_choice_object_grammar_greedy_and_sampled(client):
    regex = r"[A-Z][a-z]{2,6}-[0-9]{2,4}"
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 3}):
        texts, _ = _run(client, structured_output={"regex": regex}, max_tokens=24, **kwargs)
        assert len(texts) == kwargs.get("n", 1) and all(re.fullmatch(regex, t) for t in texts.values()), texts
        choices = ["yes", "no", "it depends"]
        texts, finish = _run(client, structured_output={"choice": choices}, max_tokens=16, **kwargs)
        assert all(t in choices for t in texts.values()) and set(finish.values()) == {1}, texts
    texts, _ = _run(client, structured_output={"json_object": True}, max_tokens=48, temperature=0)
    assert isinstance(json.loads(texts[0]), dict)
    grammar = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    texts, _ = _run(client, structured_output={"grammar": grammar}, max_tokens=16, temperature=1.0, seed=1, n=3)
    assert all(re.fullmatch(r"The answer is [0-9]{1,3}\.", t) for t in texts.values()), texts


def test_constraint_with_stop_string_and_seed_reproducible(client):
    kwargs = dict(structured_output={"json_schema": SCHEMAS["nested"]}, temperature=1.0, seed=11, max_tokens=64)
    assert _run(client, **kwargs) == _run(client, **kwargs)
    texts, finish = _run(client, structured_output={"regex": "[a-c]{20}"}, stop=["b"], temperature=1.0, seed=2,
                         max_tokens=24)
    assert "b" not in texts[0] and finish[0] == 1


@pytest.mark.parametrize("constraint,field", [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"), ({"grammar": "start: undefined_rule"}, "grammar"),
])
def test_bad_constraint_is_invalid_argument_naming_the_field(server, client, constraint, field):
    for _ in range(2):  # the second answer comes from the compile cache, before any scheduling
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(PROMPT, structured_output=constraint, max_tokens=4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.structured_output.{field}" in info.value.details(), info.value.details()
    assert_no_blocks_held(server)


def test_preempted_mid_json_still_ends_valid(server):
    """Twelve JSON requests in a 14-block pool: requests are preempted while decoding their JSON (with output
    tokens) and recomputed; every completion still validates."""
    schema = SCHEMAS["nested"]
    with server_sharing_model(server, num_kv_blocks=14, block_size=8, max_num_seqs=12) as small:
        engine = small.engine
        victims: list[int] = []
        original = engine.scheduler._preempt

        def record(req, out):
            victims.append(req.num_output_tokens)
            original(req, out)

        engine.scheduler._preempt = record
        from pagedserve_client import PagedServeClient

        with PagedServeClient(small.target, timeout_s=300) as c, ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda i: _run(c, structured_output={"json_schema": schema}, temperature=1.0,
                                                   seed=i, max_tokens=56), range(12)))
        assert any(n > 0 for n in victims), victims
        for texts, _ in results:
            jsonschema.validate(json.loads(texts[0]), schema)


# ---- HTTP (openai SDK) -----------------------------------------------------------------------------------------
def test_openai_sdk_response_format_json_schema_and_vllm_extras(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=300) as oai:
        schema = SCHEMAS["enum_number"]
        r = oai.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Rate red."}], max_tokens=48,
            temperature=1.0, seed=5, n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": schema}})
        for choice in r.choices:
            jsonschema.validate(json.loads(choice.message.content), schema)
            assert choice.finish_reason == "stop"
        r = oai.completions.create(model="SmolLM2-135M-Instruct", prompt="Pick:", max_tokens=8, temperature=0,
                                   extra_body={"structured_outputs": {"choice": ["left", "right"]}})
        assert r.choices[0].text in ("left", "right")
        r = oai.completions.create(model="SmolLM2-135M-Instruct", prompt="Code:", max_tokens=8, temperature=0,
                                   extra_body={"guided_regex": "[0-9]{4}"})
        assert re.fullmatch("[0-9]{4}", r.choices[0].text)
        for extra, param in (({"guided_regex": "(bad"}, "guided_regex"),
                             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                              "response_format.json_schema.schema"),
                             ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")):
            with pytest.raises(openai.BadRequestError) as info:
                oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=4, extra_body=extra)
            assert info.value.body["param"] == param, info.value.body
    assert_no_blocks_held(server)


# ---- the engine's wait for a compiling grammar (no model run) ---------------------------------------------------
@pytest.fixture()
def bare_engine(server):
    """An LLMEngine with the server's tokenizer and no model runner: admission and the grammar wait only."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(device="cpu"), None, server.engine.tokenizer, 64, 256,
                       server.engine.eos_token_ids, server.engine.vocab_size)
    pending: list[Future] = []

    def submit(constraint):
        pending.append(Future())
        return pending[-1]

    engine.structured.compiler.submit = submit
    yield engine, pending
    engine.structured.compiler.shutdown()


def test_requests_wait_unscheduled_until_the_grammar_compiles(server, bare_engine):
    engine, pending = bare_engine
    so = {"regex": "[0-9]+"}
    engine.add_request("ok", [1, 2, 3], SamplingParams(structured_output=so, n=2, max_tokens=4))
    engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=so, max_tokens=4))
    engine.add_request("gone", [1, 2, 3], SamplingParams(structured_output=so, max_tokens=4))
    assert engine.has_unfinished() and engine.scheduler.num_waiting == 0
    assert engine.step() == []                      # waits (briefly) for a compile; schedules nothing
    _, aborted = engine.abort(["gone"])
    assert [d.finish_reason for d in aborted] == ["abort"]
    compiled = server.engine.structured.compiler.compile(StructuredOutput(regex="[0-9]+"))
    pending[0].set_result(compiled)
    pending[1].set_exception(InvalidInputError("no good", "sampling.structured_output.regex"))
    pending[2].set_result(compiled)
    deltas = engine._admit_compiled()
    assert [(d.request_id, d.finish_reason, type(d.error).__name__) for d in deltas] == \
        [("bad", "abort", "InvalidInputError")]
    assert engine.scheduler.num_waiting == 1 and "gone" not in engine.groups and "bad" not in engine.groups
    ok = engine.groups["ok"].children
    assert all(c.grammar is not None for c in ok) and ok[0].grammar is not ok[1].grammar
    assert not len(engine.structured)
