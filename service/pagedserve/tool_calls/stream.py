"""Streamed tool calls as OpenAI's chunks carry them, from a parser's growing snapshots.

For each call the client first gets ``{"index", "id", "type": "function", "function": {"name", "arguments"}}``
(the arguments' first fragment, possibly "") and then ``{"index", "function": {"arguments": <fragment>}}`` pieces
whose concatenation is the arguments' JSON text: the shape the ``openai`` SDK's stream helpers (and LangChain)
reassemble by ``index``. One feed gives at most one entry per call index (vLLM's shape: an SDK that does not merge
entries of one chunk by index would otherwise see a second call).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .parsers import PartialCall, ToolParser


def new_call_id() -> str:
    """A tool call id (vLLM's ``chatcmpl-tool-<hex>`` form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_dict(call_id: str, name: str, arguments: str) -> dict:
    """One complete call as ``message.tool_calls`` holds it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class _Sent:
    call_id: str = field(default_factory=new_call_id)
    header_sent: bool = False
    num_argument_chars: int = 0


class ToolCallStream:
    """Feed text deltas of one choice; get the content and tool-call deltas to send.

    Args:
        parser: reads the choice's text (see :class:`~pagedserve.tool_calls.parsers.ToolParser`).
        max_calls: report at most this many calls (1 with ``parallel_tool_calls: false``); None: all.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.text = ""
        self._content_sent = 0
        self._sent: list[_Sent] = []

    @property
    def num_calls_started(self) -> int:
        return sum(s.header_sent for s in self._sent)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """Append ``text``; returns (new content, new ``tool_calls`` delta entries). ``final`` on the last delta
        of the choice releases text held back as a possible call start."""
        self.text += text
        snap = self.parser.snapshot(self.text, final=False)
        if final and not snap.calls:
            snap = self.parser.snapshot(self.text, final=True)
        content = snap.content[self._content_sent:] if len(snap.content) > self._content_sent else ""
        self._content_sent += len(content)
        calls = snap.calls[:self.max_calls]
        deltas = (self._call_delta(i, call) for i, call in enumerate(calls))
        return content, [d for d in deltas if d is not None]

    def _call_delta(self, index: int, call: PartialCall) -> dict | None:
        """Call ``index``'s one entry for this feed: its header with the first argument fragment, then the next
        fragment; None when there is nothing new (or the name is not complete yet)."""
        while len(self._sent) <= index:
            self._sent.append(_Sent())
        sent = self._sent[index]
        if not sent.header_sent and call.name is None:
            return None
        fragment = call.arguments[sent.num_argument_chars:]
        sent.num_argument_chars = len(call.arguments)
        if not sent.header_sent:
            sent.header_sent = True
            return {"index": index, "id": sent.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": fragment}}
        return {"index": index, "function": {"arguments": fragment}} if fragment else None


def parse_whole(parser: ToolParser, text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """A finished choice's ``(content, tool_calls)``: content None when empty (OpenAI's ``null`` next to calls);
    calls whose name never completed (a length cut) are left out; at most ``max_calls`` (None: all)."""
    snap = parser.snapshot(text, final=True)
    calls = [call_dict(new_call_id(), c.name, c.arguments) for c in snap.calls[:max_calls] if c.name is not None]
    return (snap.content or None), calls
