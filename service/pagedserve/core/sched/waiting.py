"""The scheduler's waiting queue: priority first (lower first), then, within a priority, the caller with the least
recent service (:class:`.fairness.VirtualTokenCounter`), then earliest deadline first (:mod:`.deadlines`), then
arrival. A preempted request goes ahead of everything of its priority, whoever its caller.

The order of priority, deadline and arrival is a heap's; the caller choice is made at the head, among the entries of
the best priority, since the counters move every step.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from ...request import Request
from .deadlines import DeadlinePolicy
from .fairness import VirtualTokenCounter

_FRONT = float("-inf")


class WaitingQueue:
    """Requests waiting to be admitted (the engine thread only).

    Args:
        deadlines: supplies the EDF key (ignored when ``deadlines.enabled`` is False).
        fairness: the callers' counters (one caller, or none named: plain order).
    """

    def __init__(self, deadlines: DeadlinePolicy, fairness: VirtualTokenCounter):
        self.deadlines = deadlines
        self.fairness = fairness
        # heap of (priority, deadline or +inf (0 when deadlines are ignored; -inf: preempted), arrival, seq, request)
        self._heap: list[tuple[int, float, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in self._heap)

    def ordered(self) -> list[Request]:
        """The requests by priority, deadline and arrival (the caller choice aside)."""
        return [entry[-1] for entry in sorted(self._heap, key=lambda e: e[:-1])]

    def push(self, request: Request) -> None:
        edf = self.deadlines.queue_key(request) if self.deadlines.enabled else 0.0
        heapq.heappush(self._heap, (request.priority, edf, request.arrival_time, next(self._seq), request))

    def push_front(self, request: Request) -> None:
        """A preempted request: ahead of everything of its priority (-inf keeps that order stable)."""
        heapq.heappush(self._heap, (request.priority, _FRONT, _FRONT, -next(self._seq), request))

    def head(self) -> Request | None:
        """The request to admit next (None when empty)."""
        if not self._heap:
            return None
        top = self._heap[0]
        if top[1] == _FRONT or len(self.fairness.live) <= 1:
            return top[-1]
        same = sorted((e for e in self._heap if e[0] == top[0]), key=lambda e: e[:-1])
        return self.fairness.pick((e[-1].caller, e[-1]) for e in same)

    def remove(self, request: Request) -> None:
        """Take ``request`` out (the head after admission, or any entry when it ends while waiting)."""
        if self._heap and self._heap[0][-1] is request:
            heapq.heappop(self._heap)
            return
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def late(self, now: float, running: list[Request]) -> list[tuple[Request, Exception]]:
        """Waiting requests never admitted that :class:`.deadlines.DeadlinePolicy` refuses at ``now`` (deadline
        passed, cannot finish by it, or waited ``max_queue_time_s``), each with its DeadlineError; gang members
        (beam search) are not checked. Nothing is removed here."""
        out = []
        for entry in self._heap:
            req = entry[-1]
            if req.gang is None:
                error = self.deadlines.refusal(req, now, running)
                if error is not None:
                    out.append((req, error))
        return out
