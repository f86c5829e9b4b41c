"""Per-request metrics, recorded by wrapping the engine's delta stream (the servicer stays untouched).

:class:`MeteredEngine` has the :class:`~pagedserve.engine.async_engine.AsyncEngine` interface; its ``generate()``
passes every :class:`~pagedserve.engine.llm_engine.CompletionDelta` through and records, per request:

- ``generation_tokens`` as tokens stream out, ``prompt_tokens`` from the final usage;
- ``request_success{finished_reason}`` once per completion (``n`` per request), "abort" included;
- one sample each of TTFT (call to first token), TPOT ((last token - first token) / tokens after each
  completion's first), end-to-end latency (call to last delta) and queue time
  (``Request.first_scheduled_time - Request.arrival_time``, the engine's monotonic clock).

Queue time needs the engine's :class:`~pagedserve.engine.request.Request` objects, which no delta carries:
:func:`watch_requests` wraps the engine instance's ``add_request`` so that, for the requests a MeteredEngine is
waiting on, the created requests are handed over (the engine thread does the hand-over; nothing else changes).
A request the client cancels counts as finished with "abort" and gives no latency samples.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from .metrics import ServerMetrics


def watch_requests(llm_engine, sink: dict) -> None:
    """Make ``llm_engine.add_request`` store its created requests in ``sink[request_id]`` when that key is
    present (set to None by the caller beforehand). Runs on the engine thread."""
    original = llm_engine.add_request

    def add_request(request_id, *args, **kwargs):
        children = original(request_id, *args, **kwargs)
        if request_id in sink:
            sink[request_id] = children
        return children

    llm_engine.add_request = add_request


class _RequestTimes:
    """What one request's stream has shown so far (monotonic seconds)."""

    __slots__ = ("start", "first_token", "last_token", "tokens", "first_tokens", "open_completions")

    def __init__(self, start: float, n: int):
        self.start = start
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.tokens = 0                  # over all completions
        self.first_tokens: set[int] = set()  # completions that produced their first token
        self.open_completions = n


class MeteredEngine:
    """An AsyncEngine whose ``generate()`` records request metrics; every other attribute is the engine's."""

    def __init__(self, inner, metrics: ServerMetrics, model_name: str):
        self._inner = inner
        self._metrics = metrics
        self._model = model_name
        self._requests: dict[str, list | None] = {}
        watch_requests(inner.engine, self._requests)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator:
        """``AsyncEngine.generate`` with metrics; same arguments, deltas and exceptions."""
        times = _RequestTimes(time.monotonic(), params.n)
        owner = request_id not in self._requests  # a duplicate id is refused by the engine: leave the live one's
        if owner:
            self._requests[request_id] = None
        stream = self._inner.generate(request_id, prompt_token_ids, params, priority, cache_salt)
        finished = False
        try:
            async for delta in stream:
                self._on_delta(delta, times)
                if delta.usage is not None:
                    finished = True
                    self._on_finished(delta.usage, times, self._requests.get(request_id))
                yield delta
        finally:
            await stream.aclose()
            children = self._requests.pop(request_id, None) if owner else None
            if not finished and children is not None:  # added, then cancelled by the client or failed
                self._on_cancelled(times, children)

    def _on_delta(self, delta, times: _RequestTimes) -> None:
        m, label = self._metrics, self._model
        now = time.monotonic()
        if delta.token_ids:
            m.generation_tokens.labels(label).inc(len(delta.token_ids))
            times.tokens += len(delta.token_ids)
            times.first_tokens.add(delta.index)
            times.last_token = now
            if times.first_token is None:
                times.first_token = now
                m.ttft.labels(label).observe(now - times.start)
        if delta.finish_reason is not None:
            times.open_completions -= 1
            m.request_success.labels(label, delta.finish_reason).inc()

    def _on_finished(self, usage, times: _RequestTimes, children: list | None) -> None:
        m, label = self._metrics, self._model
        m.prompt_tokens.labels(label).inc(usage.prompt_tokens)
        m.e2e.labels(label).observe(time.monotonic() - times.start)
        decode_tokens = times.tokens - len(times.first_tokens)
        if decode_tokens > 0:
            m.tpot.labels(label).observe((times.last_token - times.first_token) / decode_tokens)
        queue_s = _queue_time_s(children)
        if queue_s is not None:
            m.queue_time.labels(label).observe(queue_s)

    def _on_cancelled(self, times: _RequestTimes, children: list) -> None:
        m, label = self._metrics, self._model
        if times.open_completions > 0:
            m.request_success.labels(label, "abort").inc(times.open_completions)
        if times.first_token is not None:  # the prompt was prefilled
            m.prompt_tokens.labels(label).inc(children[0].num_prompt_tokens)


def _queue_time_s(children: list | None) -> float | None:
    """Seconds from arrival to the first scheduling of any of the request's completions (None: never)."""
    if not children:
        return None
    scheduled = [c.first_scheduled_time for c in children if c.first_scheduled_time is not None]
    return max(0.0, min(scheduled) - children[0].arrival_time) if scheduled else None
