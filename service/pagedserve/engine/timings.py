"""Per-request timings for tracing, recorded on the engine thread (vLLM's way: the hot path only notes monotonic
times; the spans are built from them once the request has ended, :mod:`pagedserve.serving.call_trace`).

Only requests that came with an :class:`~pagedserve.outputs.EngineTimings` are followed; with none live (tracing
off, or no traced request running) a step costs one truth test of an empty dict.
"""
from __future__ import annotations

from ..outputs import EngineTimings
from ..request import Request


class TimingRecorder:
    """The traced requests still live and what their timings say so far. Used by the engine thread only."""

    def __init__(self) -> None:
        self._live: dict[Request, int] = {}   # traced request -> output tokens it had after the previous step

    def __bool__(self) -> bool:
        return bool(self._live)

    def add(self, requests: list[Request], timings: EngineTimings) -> None:
        """Follow the completions of one request (just queued), all recording into ``timings``."""
        for req in requests:
            req.timings = timings
            self._live[req] = req.num_output_tokens

    def on_step(self, start: float, end: float, composition: dict[str, int]) -> None:
        """One step ran from ``start`` to ``end`` (monotonic seconds) and computed ``composition[request_id]``
        tokens of each request it scheduled (:attr:`Scheduler.last_step_composition`); the followed requests it
        finished are dropped, with their preemptions counted."""
        ended = []
        for req, seen in self._live.items():
            t: EngineTimings = req.timings
            n = composition.get(req.request_id, 0)
            if n:
                self._on_scheduled(req, t, seen, start, end, n)
                self._live[req] = req.num_output_tokens
            if req.is_finished:
                ended.append(req)
        for req in ended:
            req.timings.num_preemptions += req.num_preemptions
            del self._live[req]

    @staticmethod
    def _on_scheduled(req: Request, t: EngineTimings, seen: int, start: float, end: float, n: int) -> None:
        if t.first_scheduled is None or (req.first_scheduled_time or end) < t.first_scheduled:
            t.first_scheduled = req.first_scheduled_time
        if req.index == 0:
            if seen == 0:   # no token yet: a prefill chunk (the last one samples the first token)
                t.prefill_chunks.append((max(start, req.first_scheduled_time or start), end, n))
                t.num_cached_tokens = max(req.num_cached_tokens, 0)
            else:
                t.num_decode_steps += 1
        if req.num_output_tokens > seen:
            if seen == 0 and (t.first_token is None or end < t.first_token):
                t.first_token = end
            t.last_token = end if t.last_token is None else max(t.last_token, end)
