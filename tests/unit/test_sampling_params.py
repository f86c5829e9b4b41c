"""SamplingParams: API.md defaults, normalization, and INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import dataclasses
import math

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutput
from pagedserve.errors import InvalidInputError


def test_defaults_match_the_api():
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (None, 0, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos, p.n) == ((), (), False, False, 1)
    assert (p.logprobs, p.prompt_logprobs, p.skip_special_tokens, p.logit_bias, p.truncate_prompt_tokens) == \
        (None, None, True, (), None)
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_field_names_match_the_proto():
    from support import REPO_ROOT

    proto = (REPO_ROOT / "protos/pagedserve/v1/inference.proto").read_text()
    block = proto[proto.index("message SamplingParams {"):]
    block = block[:block.index("\n}")]
    proto_fields = {line.split("=")[0].split()[-1] for line in block.splitlines() if "=" in line
                    and not line.strip().startswith("//")}
    # beam_search travels beside the sampling message (GenerateRequest.beam_search), not inside it
    assert proto_fields == {f.name for f in dataclasses.fields(SamplingParams)} - {"beam_search"}


def test_normalization_and_hashing():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[5, 3], logit_bias={9: 1, 2: -0.5}, temperature=1)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (5, 3)
    assert p.logit_bias == ((2, -0.5), (9, 1.0)) and isinstance(p.temperature, float)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(5, 3), logit_bias=[(9, 1.0), (2, -0.5)]))
    assert SamplingParams(stop="x").stop == ("x",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


BAD = [
    ("temperature", {"temperature": -0.1}), ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}), ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": math.nan}), ("top_k", {"top_k": -1}), ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}), ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.01}), ("frequency_penalty", {"frequency_penalty": -math.inf}),
    ("repetition_penalty", {"repetition_penalty": 0.0}), ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("stop", {"stop": ["ok", ""]}), ("stop", {"stop": [3]}), ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("n", {"n": 0}), ("max_tokens", {"max_tokens": 0}), ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}), ("seed", {"seed": -1}), ("seed", {"seed": 2**64}),
    ("logprobs", {"logprobs": -1}), ("prompt_logprobs", {"prompt_logprobs": -2}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}), ("logit_bias", {"logit_bias": {1: math.nan}}),
    ("logit_bias", {"logit_bias": {-3: 1.0}}), ("logit_bias", {"logit_bias": [(1, 1.0), (1, 2.0)]}),
    ("top_k", {"top_k": 1.5}), ("n", {"n": True}), ("ignore_eos", {"ignore_eos": 1}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_invalid_values_name_the_field(field, kwargs):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == f"sampling.{field}"
    assert str(info.value).startswith(f"sampling.{field}: ")


def test_edges_that_are_valid():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=1e-3, seed=2**64 - 1, max_tokens=1, min_tokens=1, logprobs=0, top_k=0)


def test_validate_for_model():
    SamplingParams(stop_token_ids=[99], logit_bias={99: 1.0}, logprobs=20).validate_for_model(100)
    for field, kwargs in [("stop_token_ids", {"stop_token_ids": [100]}), ("logit_bias", {"logit_bias": {100: 1}}),
                          ("logprobs", {"logprobs": 21}), ("prompt_logprobs", {"prompt_logprobs": 6})]:
        with pytest.raises(InvalidInputError) as info:
            SamplingParams(**kwargs).validate_for_model(100, max_logprobs=20 if field != "prompt_logprobs" else 5)
        assert info.value.field == f"sampling.{field}"


def test_the_proto_and_the_engine_name_the_same_sampling_fields():
    """The sampling fields are listed once per side (the proto message, the engine dataclass); the server's
    conversion and the client's builder walk the descriptor, so the two sets must be equal."""
    import dataclasses

    from pagedserve_client.v1 import inference_pb2 as pb

    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"beam_search"}  # GenerateRequest's
    assert engine_fields == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def test_every_proto_sampling_field_reaches_the_engine_params():
    """Each field set on the wire (to a non-default value) arrives in SamplingParams with that value."""
    from pagedserve.grpc_api.convert import sampling_from_proto
    from pagedserve_client import sampling_params

    values = dict(max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.75, top_k=3, min_p=0.25, seed=11,
                  presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25, stop=["x", "yy"],
                  stop_token_ids=[5, 9], include_stop_str_in_output=True, ignore_eos=True, n=2, logprobs=3,
                  prompt_logprobs=1, skip_special_tokens=False, logit_bias={4: 1.5}, truncate_prompt_tokens=9,
                  structured_output={"choice": ["a", "b"]})
    params = sampling_from_proto(sampling_params(**values))
    expected = {**values, "stop": ("x", "yy"), "stop_token_ids": (5, 9), "logit_bias": ((4, 1.5),),
                "structured_output": StructuredOutput(choice=("a", "b"))}
    assert {name: getattr(params, name) for name in values} == expected
    assert set(values) == {f.name for f in sampling_params().DESCRIPTOR.fields}
