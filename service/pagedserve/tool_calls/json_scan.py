"""A scanner for JSON objects that may still be arriving: where each top-level key's value starts and (once its
text is complete) ends, so tool-call names and argument text can be streamed before the object closes.

Only the structure is scanned (strings with escapes, nesting); values are parsed by ``json`` once complete.
Errors: :class:`ValueError` for text that cannot become JSON (a non-string key, a missing colon, ...).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ScannedObject:
    """One JSON object found at ``start`` of a text that may end early."""

    values: dict[str, tuple[int, int | None]]  # key -> (start, end) of its value's text; end None: not complete
    end: int | None                           # index after the closing brace; None: the object is not complete

    def text_of(self, text: str, key: str) -> str | None:
        """The value's raw text so far (a prefix while incomplete); None when the key has not appeared."""
        span = self.values.get(key)
        if span is None:
            return None
        return text[span[0]:] if span[1] is None else text[span[0]:span[1]]

    def string(self, text: str, key: str) -> str | None:
        """The key's value when it is a complete JSON string, else None."""
        span = self.values.get(key)
        if span is None or span[1] is None:
            return None
        try:
            value = json.loads(text[span[0]:span[1]])
        except ValueError:
            return None
        return value if isinstance(value, str) else None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the string starting at ``text[i] == '"'``; None when it has not closed yet."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``i`` (a string, object, array, number or literal); None when the
    text ends before it does (a number or literal at the very end counts as not complete)."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            depth += c in "{["
            depth -= c in "}]"
            i += 1
            if depth == 0:
                return i
        return None
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None


def scan_object(text: str, i: int) -> ScannedObject:
    """Scan the object whose ``{`` is at ``text[i]``. Raises ValueError where the text cannot be JSON."""
    if text[i] != "{":
        raise ValueError(f"expected '{{' at {i}")
    values: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        return ScannedObject(values, i + 1)
    while i < len(text):
        if text[i] != '"':
            raise ValueError(f"expected a key at {i}")
        key_end = _string_end(text, i)
        if key_end is None:
            break
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        start = skip_ws(text, i + 1)
        if start >= len(text):
            break
        end = value_end(text, start)
        values[key] = (start, end)
        if end is None:
            break
        i = skip_ws(text, end)
        if i >= len(text):
            break
        if text[i] == "}":
            return ScannedObject(values, i + 1)
        if text[i] != ",":
            raise ValueError(f"expected ',' or '}}' at {i}")
        i = skip_ws(text, i + 1)
    return ScannedObject(values, None)
