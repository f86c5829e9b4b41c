"""One schema per field set: the HTTP bodies' sampling fields, the gRPC conversion and the config choices all come
from the dataclasses' own fields, so adding a SamplingParams field reaches every front end or fails here."""
from __future__ import annotations

import dataclasses

import pytest

from pagedserve.config import EngineConfig, ServerConfig
from pagedserve.sampling_params import FLOAT_FIELDS, SamplingParams
from pagedserve.errors import InvalidInputError
from pagedserve.http import convert
from pagedserve.http.protocol import (SAMPLING_BODY_FIELDS, SAMPLING_SHAPED_FIELDS, ChatCompletionRequest,
                                      CompletionRequest)
from pagedserve_client.v1 import inference_pb2 as pb

ENGINE_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def test_http_body_fields_and_shaped_fields_are_the_sampling_params_fields():
    assert set(SAMPLING_BODY_FIELDS) | set(SAMPLING_SHAPED_FIELDS) == ENGINE_FIELDS
    assert not set(SAMPLING_BODY_FIELDS) & set(SAMPLING_SHAPED_FIELDS)
    for body in (ChatCompletionRequest, CompletionRequest):
        assert set(SAMPLING_BODY_FIELDS) <= set(body.model_fields)


def test_grpc_sampling_message_has_the_engine_fields_less_beam_search():
    # beam_search travels as its own GenerateRequest field (grpc_api/convert.py adds it)
    assert {fd.name for fd in pb.SamplingParams.DESCRIPTOR.fields} == ENGINE_FIELDS - {"beam_search"}


def test_float_fields_come_from_the_annotations():
    assert set(FLOAT_FIELDS) == {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                 "repetition_penalty"}


def test_every_body_sampling_field_reaches_the_engine():
    values = {"min_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3,
              "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "stop": ["x"],
              "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True, "n": 2,
              "skip_special_tokens": False, "logit_bias": {"4": 1.5}, "truncate_prompt_tokens": 9}
    assert set(values) == set(SAMPLING_BODY_FIELDS), "a new sampling field needs a value here"
    params = convert.sampling_params(CompletionRequest(prompt="hi", **values), 4, None)
    expected = {**values, "stop": ("x",), "stop_token_ids": (5,), "logit_bias": ((4, 1.5),)}
    assert {name: getattr(params, name) for name in values} == expected


def test_fields_that_reshape_the_distribution_are_refused_with_beams_from_their_metadata():
    shaped = [f for f in dataclasses.fields(SamplingParams) if f.metadata.get("shapes_distribution")]
    assert {f.name for f in shaped} >= {"top_p", "top_k", "logit_bias", "logprobs", "structured_output"}
    other = {"top_p": 0.5, "top_k": 3, "min_p": 0.5, "presence_penalty": 1.0, "frequency_penalty": 1.0,
             "repetition_penalty": 1.2, "logprobs": 1, "prompt_logprobs": 1, "logit_bias": {1: 1.0},
             "structured_output": {"regex": "a+"}}
    for f in shaped:
        with pytest.raises(InvalidInputError, match=f.name):
            SamplingParams(temperature=0, n=1, beam_search={"beam_width": 2}, **{f.name: other[f.name]})


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_config_choices_are_checked_from_the_field_metadata(cls):
    with_choices = [f for f in dataclasses.fields(cls) if f.metadata.get("choices")]
    assert with_choices
    for f in with_choices:
        with pytest.raises(ValueError, match=f"^{f.name}: unknown value 'bogus'"):
            cls(**{f.name: "bogus"})
        for value in f.metadata["choices"]:
            if f.name != "kv_cache_dtype" or value == "auto":  # other cache types are CPU-only and checked later
                cls(**{f.name: value})


def test_none_passes_the_choices_only_where_it_is_the_default():
    assert ServerConfig(tool_call_parser=None).tool_call_parser is None
    with pytest.raises(ValueError, match="^dtype: unknown value None"):
        EngineConfig(dtype=None)
