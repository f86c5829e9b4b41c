"""Fuzzing the live server (issue 10): hypothesis builds raw protobuf requests with random and extreme values
(huge and out-of-range numbers, NaN/inf floats, long and binary-looking strings, empty and oversized repeated
fields, invalid UTF-8 on the wire) and sends them through the generated stubs, so the client library's checks never
filter them. Every answer must be OK or a client-error status whose message names the field, never INTERNAL or
UNKNOWN, never a hang; afterwards the server is SERVING and every KV block is free.

Cheap by design (~2,000 cases in about a minute on 2 CPU cores): accepted Generate calls ask for a few tokens (or
are cancelled by the test after a few messages) and finish in the background, many at once, so the engine batches
them; rejections arrive within milliseconds and are checked (and shrunk) at once. A longer run:
``FUZZ_SCALE=10 .venv/bin/python -m pytest tests/test_fuzz.py`` (10x the examples, random instead of fixed draws).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import re
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.engine import sampling_params as sp
from pagedserve_client import pb
from pagedserve_client.v1 import inference_pb2_grpc

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
U32, U64, I32 = 2**32 - 1, 2**64 - 1, 2**31 - 1
SERVICE = "/pagedserve.v1.InferenceService/"
CLIENT_ERRORS = {"INVALID_ARGUMENT", "ALREADY_EXISTS"}     # the only failures these requests may get
QUICK_S = 0.05          # a rejection normally arrives within this; slower calls finish in the background
MAX_PENDING = 48        # background calls at most (the engine batches them)
CALL_TIMEOUT_S = 90.0   # a call still open after this is a hang
READ_LIMIT = 4          # calls that could run long are cancelled by the test after this many messages


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    derandomize=SCALE == 1, suppress_health_check=list(HealthCheck))


def field_paths(descriptor, prefix: str = "") -> set[str]:
    """Every dotted field path (and oneof name) of a message type: the names an error message may start with."""
    out = {prefix + o.name for o in descriptor.oneofs}
    for f in descriptor.fields:
        out.add(prefix + f.name)
        if f.message_type is not None and not f.message_type.GetOptions().map_entry:
            out |= field_paths(f.message_type, f"{prefix}{f.name}.")
    return out


@dataclass
class Outcome:
    code: str                       # final status name
    details: str
    messages: list = field(default_factory=list)
    cancelled_by_test: bool = False


@dataclass
class Limits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    embedding_dimension: int
