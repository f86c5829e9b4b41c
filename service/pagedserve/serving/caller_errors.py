"""Errors as the caller sees them: one table from exception to a neutral :class:`ErrorKind` (each front end maps a
kind to its wire status: ``grpc_api/interceptors.py``, ``http/errors.py``), and :class:`FieldNames`, how a caller
spells the request fields an error names.

The engine's errors name its own fields (``prompt``, ``prompt_token_ids``, ``sampling.max_tokens``,
``sampling.structured_output.json_schema``): the gRPC API's names. A front end whose wire spells them otherwise
(the OpenAI body's ``max_completion_tokens``, ``messages``, ``response_format``) hands a :class:`FieldNames` with
the request, and :func:`caller_error` gives every error in those names.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from .. import errors
from ..sampling_params import STRUCTURED_OUTPUT_FIELD


class ErrorKind(enum.Enum):
    """What went wrong, front-end neutral (the status each API answers with is its own)."""

    INVALID_INPUT = "invalid_input"            # bad request content (names the field)
    DUPLICATE_REQUEST = "duplicate_request"    # a live request already has this request_id
    QUEUE_FULL = "queue_full"                  # the waiting queue is full
    DEADLINE = "deadline"                      # cannot finish before the call's deadline: refused before prefill
    UNAVAILABLE = "unavailable"                # loading, shutting down, or the engine died
    MODEL_NOT_LOADED = "model_not_loaded"      # the call needs a model this server does not serve
    INTERNAL = "internal"                      # anything else: a bug


_KIND_OF: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (errors.InvalidInputError, ErrorKind.INVALID_INPUT),
    (errors.DuplicateRequestError, ErrorKind.DUPLICATE_REQUEST),
    (errors.QueueFullError, ErrorKind.QUEUE_FULL),
    (errors.DeadlineError, ErrorKind.DEADLINE),
    (errors.EngineUnavailableError, ErrorKind.UNAVAILABLE),
    (errors.ModelNotLoadedError, ErrorKind.MODEL_NOT_LOADED),
)


def error_kind(exc: BaseException) -> ErrorKind:
    """The kind of ``exc``: its :mod:`pagedserve.errors` class, else INTERNAL."""
    for cls, kind in _KIND_OF:
        if isinstance(exc, cls):
            return kind
    return ErrorKind.INTERNAL


SAMPLING_PREFIX = "sampling."
"""How the engine's errors prefix a sampling field (``sampling.temperature``), as the gRPC API nests them."""

_NAME = r"(?:[A-Za-z_][A-Za-z0-9_]*)?"    # a field name (``text_1``), or nothing
_HEAD_WITH_FIRST_INDEX = re.compile(_NAME + r"(\[0\])?")
_HEAD = re.compile(_NAME)


@dataclass(frozen=True, slots=True)
class FieldNames:
    """How a caller spells the request fields the engine's errors name. The default is the engine's own spelling
    (the gRPC API's).

    Args:
        renames: the engine's leading field name -> the caller's (``max_tokens`` -> ``max_completion_tokens``,
            ``inputs`` -> ``input``); a key may end in ``[0]`` to rename only the first element's field.
        prefix: dropped from the engine's field first (``sampling.``: a body holding the sampling fields at its
            top level).
        constraint: the caller's field that gave the structured-output constraint (``response_format``,
            ``tools``): it stands for every ``sampling.structured_output...`` field as a whole; None keeps those.
    """

    renames: dict[str, str] = field(default_factory=dict)
    prefix: str = ""
    constraint: str | None = None

    def caller_field(self, name: str | None) -> str | None:
        """``name`` (an engine field) as the caller spells it; None stays None."""
        if name is None:
            return None
        if self.constraint is not None and name.startswith(STRUCTURED_OUTPUT_FIELD):
            return self.constraint
        name = name.removeprefix(self.prefix)
        head = _HEAD_WITH_FIRST_INDEX.match(name).group(0)
        if head not in self.renames:
            head = _HEAD.match(name).group(0)
        if head and head in self.renames:
            return self.renames[head] + name[len(head):]
        return name


ENGINE_NAMES = FieldNames()
"""The engine's own field names (the gRPC API's)."""


@dataclass(frozen=True, slots=True)
class CallerError:
    """An exception as the caller is told about it."""

    kind: ErrorKind
    message: str              # without the field
    field: str | None = None  # the request field at fault, as the caller spells it
    code: str | None = None   # a short machine-readable reason (``context_length_exceeded``), when there is one

    def text(self) -> str:
        """``"<field>: <message>"`` (the message alone without a field)."""
        return f"{self.field}: {self.message}" if self.field else self.message


def caller_error(exc: BaseException, fields: FieldNames = ENGINE_NAMES) -> CallerError:
    """``exc`` as the caller sees it: its kind, its message and the field it names in ``fields``' spelling (a
    context-length error names the prompt as the caller does: "in the messages"), its code; an INTERNAL error's
    message names the exception's type."""
    kind = error_kind(exc)
    if kind is ErrorKind.INTERNAL:
        return CallerError(kind, f"internal error: {type(exc).__name__}: {exc}")
    engine_field = getattr(exc, "field", None)
    message = str(exc)
    if engine_field and message.startswith(f"{engine_field}: "):
        message = message[len(engine_field) + 2:]
    if isinstance(exc, errors.ContextLengthError):
        message = exc.message_for(_HEAD.match(fields.caller_field("prompt")).group(0))
    return CallerError(kind, message, fields.caller_field(engine_field), getattr(exc, "code", None))
