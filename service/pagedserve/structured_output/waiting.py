"""Requests whose grammar is still compiling: they are not in the scheduler (they take no slot, no KV block) until
their compile finishes, fails, or runs past the compile time limit."""
from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError

COMPILE_TIMEOUT_S = 10.0
"""Longest a request waits for its grammar (queueing on the compile threads included) before it fails with
INVALID_ARGUMENT: a constraint that takes longer is too complex to serve. The library's own limits
(``LLParserLimits``) bound the work of one compile, so a thread is never held for long."""


@dataclass(slots=True)
class Waiting:
    key: Any            # what the engine waits with (its request group)
    future: Future      # of the CompiledGrammar
    field: str          # the constraint's request field, for the timeout error
    deadline: float     # time.monotonic() after which the request fails


class GrammarWaitList:
    """Entries in arrival order. Used by the engine thread only.

    Args:
        timeout_s: the compile time limit per request.
    """

    def __init__(self, timeout_s: float = COMPILE_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._entries: list[Waiting] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key, future: Future, field: str) -> None:
        self._entries.append(Waiting(key, future, field, time.monotonic() + self.timeout_s))

    def pop_settled(self) -> list[tuple[Any, Any, BaseException | None]]:
        """Remove and return the entries that are settled: ``(key, CompiledGrammar, None)`` when compiled,
        ``(key, None, error)`` when the compile failed (InvalidInputError naming the field) or timed out."""
        now, out, keep = time.monotonic(), [], []
        for w in self._entries:
            if w.future.done():
                exc = w.future.exception()
                out.append((w.key, None, exc) if exc is not None else (w.key, w.future.result(), None))
            elif now >= w.deadline:
                out.append((w.key, None, InvalidInputError(
                    f"the constraint did not compile within {self.timeout_s:g} s", w.field)))
            else:
                keep.append(w)
        self._entries = keep
        return out

    def wait(self, timeout_s: float) -> None:
        """Block until some compile finishes, the first deadline passes, or ``timeout_s``."""
        if not self._entries:
            return
        first_deadline = min(w.deadline for w in self._entries) - time.monotonic()
        concurrent.futures.wait([w.future for w in self._entries], max(0.0, min(timeout_s, first_deadline)),
                                return_when=concurrent.futures.FIRST_COMPLETED)
