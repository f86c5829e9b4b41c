"""The incremental reasoning / content splitter: text in as it is generated, each piece routed to reasoning,
content or dropped (markup), with a possible tag prefix at the end of the text held back until the next piece
settles it, so that a tag cut across tokens or stream chunks is never shown in part.

A parser (:mod:`.parsers`) is a small state machine over text markers: each state says where its text goes
(``"reasoning"``, ``"content"``, ``"drop"`` for markup, or ``"capture"`` for a header whose text picks the next
state) and which markers leave it. The splitter is the one runtime both the request pipeline (the text a client
sees) and the engine (when a structured-output grammar starts, :mod:`.gate`) use, so they agree on where the
reasoning ends. Semantics follow vLLM's reasoning parsers (``vllm/reasoning/``), re-derived here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

REASONING, CONTENT, DROP, CAPTURE = "reasoning", "content", "drop", "capture"


@dataclass(frozen=True, slots=True)
class State:
    """One state of a parser.

    Attributes:
        kind: where its text goes: REASONING, CONTENT, DROP or CAPTURE (kept for :meth:`Parser.after_capture`).
        markers: ``(marker text, next state name)`` pairs that leave it, tried at the earliest position (the
            longest marker first where two start at the same place).
        leading: the markers count only at the start of the state's text (after whitespace, which is dropped
            when a marker follows); any other text moves to ``otherwise`` (Qwen3: ``<think>`` opens reasoning only
            as the first thing generated).
        otherwise: the state text that is not a leading marker moves to (with ``leading``).
    """

    kind: str
    markers: tuple[tuple[str, str], ...] = ()
    leading: bool = False
    otherwise: str | None = None


@dataclass(slots=True)
class Split:
    """What one :meth:`ReasoningSplitter.feed` produced."""

    reasoning: str = ""
    content: str = ""
    touched_reasoning: bool = False   # the piece was read (even in part) in a reasoning state


class Parser:
    """A reasoning format (subclasses in :mod:`.parsers`): states by name, and the state a completion starts in
    given the end of its prompt."""

    name = ""
    states: dict[str, State] = {}

    def start_state(self, prompt_tail: str) -> str:
        """The state a completion starts in; ``prompt_tail`` is the end of the rendered prompt (a template may
        already have opened the reasoning, e.g. DeepSeek-R1's ``<think>`` at the end of the generation prompt)."""
        raise NotImplementedError

    def after_capture(self, captured: str, marker: str) -> str:
        """The state after a CAPTURE state's ``marker``, from the captured text (a gpt-oss channel header)."""
        raise NotImplementedError

    def splitter(self, prompt_tail: str = "") -> "ReasoningSplitter":
        """A fresh incremental splitter for one completion."""
        return ReasoningSplitter(self, self.start_state(prompt_tail))


@dataclass(slots=True)
class ReasoningSplitter:
    """One completion's text through a :class:`Parser` (not thread-safe; one per completion).

    Attributes:
        parser: the format.
        state: the current state's name.
    """

    parser: Parser
    state: str
    _held: str = ""
    _captured: list[str] = field(default_factory=list)

    @property
    def in_reasoning(self) -> bool:
        """The current state's text is reasoning."""
        return self.parser.states[self.state].kind == REASONING

    @property
    def reasoning_ended(self) -> bool:
        """The completion is past its reasoning: the current state's text is content (a structured-output grammar
        may start). A state that may still open reasoning (Qwen3 before its first text) is not."""
        st = self.parser.states[self.state]
        return st.kind == CONTENT and not st.leading

    def snapshot(self) -> tuple:
        """The splitter's position, for :meth:`restore`."""
        return self.state, self._held, tuple(self._captured)

    def restore(self, snap: tuple) -> None:
        """Go back to a :meth:`snapshot`."""
        self.state, self._held, captured = snap
        self._captured = list(captured)

    def feed(self, text: str, final: bool = False) -> Split:
        """Route ``text`` (the completion's next piece); ``final`` on its last piece flushes what is held.

        Returns:
            the reasoning and content text that is settled now (held text comes out with a later piece).
        """
        out = Split()
        buf = self._held + text
        self._held = ""
        while True:
            st = self.parser.states[self.state]
            if st.kind == REASONING:
                out.touched_reasoning = True
            if not st.markers:
                self._emit(st, buf, out)
                return out
            if st.leading:
                buf, moved = self._leading(st, buf, final)
                if not moved:
                    return out
                continue
            hit = _earliest(buf, st.markers)
            if hit is None:
                keep = 0 if final else _held_suffix(buf, st.markers)
                self._emit(st, buf[:len(buf) - keep], out)
                self._held = buf[len(buf) - keep:]
                if final and st.kind == CAPTURE:
                    self._captured.clear()
                return out
            pos, marker, nxt = hit
            self._emit(st, buf[:pos], out)
            buf = buf[pos + len(marker):]
            if st.kind == CAPTURE:
                nxt = self.parser.after_capture("".join(self._captured), marker)
                self._captured.clear()
            self.state = nxt

    def _leading(self, st: State, buf: str, final: bool) -> tuple[str, bool]:
        """A leading-marker state: ``(rest of buf, whether the state changed)``; text that may still become the
        marker (whitespace, a marker prefix) is held."""
        body = buf.lstrip()
        for marker, nxt in st.markers:
            if body.startswith(marker):
                self.state = nxt
                return body[len(marker):], True
        if not final and (not body or any(m.startswith(body) for m, _ in st.markers)):
            self._held = buf
            return "", False
        self.state = st.otherwise
        return buf, True

    def _emit(self, st: State, text: str, out: Split) -> None:
        if not text:
            return
        if st.kind == REASONING:
            out.reasoning += text
        elif st.kind == CONTENT:
            out.content += text
        elif st.kind == CAPTURE:
            self._captured.append(text)


def _earliest(buf: str, markers) -> tuple[int, str, str] | None:
    best = None
    for marker, nxt in markers:
        pos = buf.find(marker)
        if pos >= 0 and (best is None or pos < best[0] or (pos == best[0] and len(marker) > len(best[1]))):
            best = (pos, marker, nxt)
    return best


def _held_suffix(buf: str, markers) -> int:
    """Length of the longest end of ``buf`` that is the start of a marker (it may complete with the next text)."""
    longest = 0
    for marker, _ in markers:
        for k in range(min(len(marker) - 1, len(buf)), longest, -1):
            if buf.endswith(marker[:k]):
                longest = k
                break
    return longest


def split_whole(parser: Parser, text: str, prompt_tail: str = "") -> tuple[str | None, str]:
    """A finished completion's ``(reasoning, content)``: reasoning None when none was produced."""
    s = parser.splitter(prompt_tail)
    out = s.feed(text, final=True)
    return (out.reasoning if out.touched_reasoning else None), out.content
