"""Tool-call parsers: model output text -> (content, tool calls), whole or while it streams.

Every parser answers one question, :meth:`ToolParser.snapshot`: given all the text generated so far, what content
and which calls (name, argument text so far) can be reported *for sure*. Snapshots only grow as text arrives, so
a stream is the difference between consecutive snapshots (:mod:`.stream`) and the whole response is the last one.

Parsers (vLLM's ``--tool-call-parser`` names and formats):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro, Qwen2/2.5
  templates); content is the text before the first block.
- ``llama3_json``: Llama 3.1/3.2's JSON tool calls: the output (after an optional ``<|python_tag|>``) is
  ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other output is content.

:class:`NamedCallParser` and :class:`RequiredCallsParser` read the output that ``tool_choice`` named / required
constrains (:mod:`.constraint`): the arguments object itself, or a JSON array of ``{"name", "parameters"}``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .json_scan import ScannedObject, scan_object, skip_ws, value_end


@dataclass(frozen=True, slots=True)
class PartialCall:
    """A tool call as far as the text shows it."""

    name: str | None                   # None until the name's string is complete
    arguments: str                     # the arguments' JSON text so far (all of it once ``complete``)
    complete: bool                     # the call's JSON has closed


@dataclass(frozen=True, slots=True)
class Snapshot:
    content: str                       # plain text for the client (held back where it may start a call)
    calls: tuple[PartialCall, ...]


class ToolParser:
    """The interface: ``snapshot(text, final)``. ``final`` is True for the whole output: nothing is held back,
    and output whose calls are not valid JSON is returned as content with no calls (vLLM's fallback)."""

    def snapshot(self, text: str, final: bool) -> Snapshot:
        raise NotImplementedError


def _call(text: str, obj: ScannedObject, args_keys: tuple[str, ...]) -> PartialCall:
    name = obj.string(text, "name")
    args = next((a for a in (obj.text_of(text, k) for k in args_keys) if a is not None), None)
    if args is None:
        args = "{}" if obj.end is not None else ""
    return PartialCall(name, args, obj.end is not None)


def _valid(call: PartialCall) -> bool:
    if not call.complete or call.name is None:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


def _held_back(text: str, marker: str) -> str:
    """``text`` less a tail that may be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


def _scan_or_none(text: str, i: int) -> ScannedObject | None:
    try:
        return scan_object(text, i)
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        first = text.find(self.START)
        if first < 0:
            return Snapshot(text if final else _held_back(text, self.START), ())
        calls, pos = [], first
        while pos >= 0:
            i = skip_ws(text, pos + len(self.START))
            if i >= len(text):
                break
            obj = _scan_or_none(text, i) if text[i] == "{" else None
            if obj is None:
                return Snapshot(text, ()) if final else Snapshot(text[:first], tuple(calls))
            calls.append(_call(text, obj, ("arguments", "parameters")))
            if obj.end is None:
                break
            pos = text.find(self.START, obj.end)
        if final and not all(_valid(c) for c in calls):
            return Snapshot(text, ())
        return Snapshot(text[:first], tuple(calls))


class Llama3JsonToolParser(ToolParser):
    TAG = "<|python_tag|>"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]):
            return Snapshot("", ())          # may still become the tag
        if i < len(text) and text[i] != "{":
            return Snapshot(text, ())
        calls: list[PartialCall] = []
        while i < len(text):
            obj = _scan_or_none(text, i)
            if obj is None:
                return Snapshot(text, ()) if final else Snapshot("", tuple(calls))
            calls.append(_call(text, obj, ("parameters", "arguments")))
            if obj.end is None:
                break
            i = skip_ws(text, obj.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                break
        if final and not (calls and all(_valid(c) for c in calls)):
            return Snapshot(text, ())
        return Snapshot("", tuple(calls))


class NamedCallParser(ToolParser):
    """The output of ``tool_choice`` naming ``name``: the call's arguments object."""

    def __init__(self, name: str):
        self.name = name

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = skip_ws(text, 0)
        complete = i < len(text) and value_end(text, i) is not None
        return Snapshot("", (PartialCall(self.name, text, complete),))


class RequiredCallsParser(ToolParser):
    """The output of ``tool_choice: required``: ``[{"name": ..., "parameters": {...}}, ...]``."""

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return Snapshot(text if final else "", ())
        calls: list[PartialCall] = []
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            obj = _scan_or_none(text, i)
            if obj is None:
                break
            calls.append(_call(text, obj, ("parameters", "arguments")))
            if obj.end is None:
                break
            i = skip_ws(text, obj.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        return Snapshot("", tuple(calls))


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
"""``--tool-call-parser`` names -> parser classes; a new format is one class and one entry here."""


def make_parser(name: str) -> ToolParser:
    """The parser registered as ``name``. Raises ValueError naming the known ones."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; one of {', '.join(PARSERS)}")
    return PARSERS[name]()
