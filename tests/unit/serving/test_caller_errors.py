"""Errors as the caller sees them: one table of error kinds (each front end maps every kind to its wire status), and
the field an error names spelled as the caller's wire spells it."""
from __future__ import annotations

import grpc
import pytest

from pagedserve import errors
from pagedserve.grpc_api.interceptors import STATUS_OF as GRPC_STATUS_OF
from pagedserve.grpc_api.interceptors import status_for
from pagedserve.http.errors import BODY_NAMES, from_exception
from pagedserve.http.errors import STATUS_OF as HTTP_STATUS_OF
from pagedserve.serving.caller_errors import ENGINE_NAMES, ErrorKind, FieldNames, caller_error, error_kind


def test_every_kind_has_a_status_in_both_front_ends():
    assert set(GRPC_STATUS_OF) == set(ErrorKind) == set(HTTP_STATUS_OF)


@pytest.mark.parametrize("exc, kind, code, status", [
    (errors.InvalidInputError("bad", "prompt"), ErrorKind.INVALID_INPUT, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (errors.DuplicateRequestError("dup"), ErrorKind.DUPLICATE_REQUEST, grpc.StatusCode.ALREADY_EXISTS, 400),
    (errors.QueueFullError("full"), ErrorKind.QUEUE_FULL, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (errors.EngineUnavailableError("gone"), ErrorKind.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
    (errors.ModelNotLoadedError("none"), ErrorKind.MODEL_NOT_LOADED, grpc.StatusCode.FAILED_PRECONDITION, 404),
    (RuntimeError("bug"), ErrorKind.INTERNAL, grpc.StatusCode.INTERNAL, 500),
])
def test_one_kind_per_exception_mapped_by_each_front_end(exc, kind, code, status):
    assert error_kind(exc) is kind
    assert status_for(exc) == code
    assert from_exception(exc).status == status


def test_the_engine_names_are_the_grpc_apis():
    exc = errors.InvalidInputError("must be >= 0", "sampling.temperature")
    err = caller_error(exc, ENGINE_NAMES)
    assert (err.field, err.message, err.text()) == ("sampling.temperature", "must be >= 0", str(exc))


@pytest.mark.parametrize("fields, engine_field, caller_field", [
    (BODY_NAMES, "sampling.temperature", "temperature"),
    (BODY_NAMES, "prompt", "prompt"),
    (FieldNames({"max_tokens": "max_completion_tokens"}, "sampling."), "sampling.max_tokens", "max_completion_tokens"),
    (FieldNames({"prompt": "messages"}, "sampling."), "prompt", "messages"),
    (FieldNames({"inputs": "input"}), "inputs[2]", "input[2]"),
    (FieldNames({"inputs[0]": "input", "inputs": "input"}), "inputs[0]", "input"),
    (FieldNames({"inputs": "input"}), "inputs[0]", "input[0]"),
    (FieldNames(prefix="sampling.", constraint="response_format"), "sampling.structured_output.regex",
     "response_format"),
    (FieldNames(prefix="sampling."), "sampling.structured_output.regex", "structured_output.regex"),
    (BODY_NAMES, None, None),
])
def test_fields_as_the_caller_spells_them(fields, engine_field, caller_field):
    assert fields.caller_field(engine_field) == caller_field


def test_an_openai_error_names_the_body_field_once():
    err = from_exception(errors.InvalidInputError("must be >= 1", "sampling.max_tokens"),
                         FieldNames({"max_tokens": "max_completion_tokens"}, "sampling."))
    assert (err.status, err.param, err.message) == (400, "max_completion_tokens",
                                                     "max_completion_tokens: must be >= 1")


def test_an_internal_error_names_its_type():
    err = caller_error(KeyError("x"))
    assert err.kind is ErrorKind.INTERNAL and err.field is None and err.text() == "internal error: KeyError: 'x'"
