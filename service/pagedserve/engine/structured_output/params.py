"""The constraint a request puts on its output: one frozen, hashable value (also the grammar cache's key).

Mirrors the proto's ``StructuredOutput`` oneof: exactly one of ``json_schema``, ``json_object``, ``regex``,
``choice``, ``grammar``. Only cheap checks happen here (the kind, types, sizes, that a schema is JSON); whether a
schema, regex or grammar compiles is the grammar library's answer, given when the request is admitted. Every error
is :class:`~pagedserve.errors.InvalidInputError` naming ``sampling.structured_output[.<field>]``.
No import of the grammar library here: the front ends and the client-side tests use this module.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import NoReturn

from pagedserve.errors import InvalidInputError

FIELD = "sampling.structured_output"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 65536
"""Longest schema / regex / grammar text, and most characters over all choices: compiling costs grow with it."""
MAX_CHOICES = 1024
"""Most strings in ``choice``."""


def _fail(name: str | None, message: str) -> NoReturn:
    raise InvalidInputError(message, f"{FIELD}.{name}" if name else FIELD)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one constraint; build it with keywords or :meth:`from_value` (a mapping or an instance).

    Raises:
        InvalidInputError: none or several kinds set, a wrong type, a schema that is not a JSON object (or bool),
            a text past ``MAX_CONSTRAINT_CHARS``, an empty ``choice`` or one past ``MAX_CHOICES``.
    """

    json_schema: str | None = None        # a JSON Schema document, as JSON text (a dict is dumped)
    json_object: bool = False             # True: any JSON object
    regex: str | None = None              # the whole text matches it (Rust regex syntax)
    choice: tuple[str, ...] | None = None  # the text is one of these
    grammar: str | None = None            # Lark-style grammar (llguidance's dialect, or GBNF), start rule `start`

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, (Mapping, bool)):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))  # key order kept: it is the
            # order the properties are generated in
        if self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                _fail("choice", f"must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            _fail("json_object", f"must be a bool, got {self.json_object!r}")
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            _fail(None, f"set exactly one of {', '.join(KINDS)} (got {', '.join(set_kinds) or 'none'})")
        kind = set_kinds[0]
        if kind == "choice":
            self._check_choice()
        elif kind != "json_object":
            text = getattr(self, kind)
            if not isinstance(text, str):
                _fail(kind, f"must be a string, got {type(text).__name__}")
            if len(text) > MAX_CONSTRAINT_CHARS:
                _fail(kind, f"at most {MAX_CONSTRAINT_CHARS} characters are allowed, got {len(text)}")
            if kind == "json_schema":
                try:
                    doc = json.loads(text)
                except ValueError as exc:
                    _fail(kind, f"is not valid JSON: {exc}")
                if not isinstance(doc, (dict, bool)):
                    _fail(kind, f"must be a JSON object (a JSON Schema), got {type(doc).__name__}")
            elif kind == "grammar" and not text.strip():
                _fail(kind, "must not be empty")

    def _check_choice(self) -> None:
        if not self.choice:
            _fail("choice", "needs at least one string")
        if len(self.choice) > MAX_CHOICES:
            _fail("choice", f"at most {MAX_CHOICES} strings are allowed, got {len(self.choice)}")
        for c in self.choice:
            if not isinstance(c, str):
                _fail("choice", f"must be strings, got {c!r}")
        if sum(len(c) for c in self.choice) > MAX_CONSTRAINT_CHARS:
            _fail("choice", f"at most {MAX_CONSTRAINT_CHARS} characters in all are allowed")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The request field errors about this constraint name, e.g. ``sampling.structured_output.regex``."""
        return f"{FIELD}.{self.kind}"

    @classmethod
    def from_value(cls, value: object) -> "StructuredOutput":
        """An instance from an instance or a mapping of its field names (``{"regex": "[0-9]+"}``).

        Raises:
            InvalidInputError: not a mapping, an unknown key, or what the constructor raises.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            _fail(None, f"must be a mapping with one of {', '.join(KINDS)}, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            _fail(None, f"unknown field(s) {unknown}; known: {', '.join(KINDS)}")
        return cls(**value)
