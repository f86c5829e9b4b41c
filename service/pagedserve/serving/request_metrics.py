"""Per-request metrics, recorded by wrapping the engine's delta stream (the servicer stays untouched).

:class:`MeteredEngine` wraps :meth:`~pagedserve.engine.async_engine.AsyncEngine.generate`: it passes every
:class:`~pagedserve.outputs.CompletionDelta` through and records, per request:

- ``generation_tokens`` as tokens stream out, ``prompt_tokens`` from the final usage;
- ``request_success{finished_reason}`` once per completion (``n`` per request), "abort" included;
- one sample each of TTFT (call to first token), TPOT ((last token - first token) / tokens after each
  completion's first), end-to-end latency (call to last delta) and queue time
  (``Usage.queue_time_s``: arrival to first scheduling, the engine's monotonic clock).

A request the client cancels counts as finished with "abort" and gives no latency samples.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ..errors import PagedServeError
from .metrics import ServerMetrics


class _RequestTimes:
    """What one request's stream has shown so far (monotonic seconds)."""

    __slots__ = ("start", "first_token", "last_token", "tokens", "first_tokens", "open_completions",
                 "num_prompt_tokens")

    def __init__(self, start: float, n: int, num_prompt_tokens: int):
        self.num_prompt_tokens = num_prompt_tokens  # as sent (before truncate_prompt_tokens)
        self.start = start
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.tokens = 0                  # over all completions
        self.first_tokens: set[int] = set()  # completions that produced their first token
        self.open_completions = n


class MeteredEngine:
    """``AsyncEngine.generate`` wrapped to record request metrics (the only call made through it)."""

    def __init__(self, inner, metrics: ServerMetrics, model_name: str):
        self._inner = inner
        self._metrics = metrics
        self._model = model_name

    async def generate(self, request_id: str, prompt_token_ids: list[int], params, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator:
        """``AsyncEngine.generate`` with metrics; same arguments, deltas and exceptions."""
        times = _RequestTimes(time.monotonic(), params.n, len(prompt_token_ids))
        stream = self._inner.generate(request_id, prompt_token_ids, params, priority, cache_salt)
        finished = rejected = False
        try:
            async for delta in stream:
                self._on_delta(delta, times)
                if delta.usage is not None:
                    finished = True
                    self._on_finished(delta.usage, times)
                yield delta
        except PagedServeError:
            rejected = times.first_token is None  # refused before it ran (validation, queue full, duplicate id)
            raise
        finally:
            await stream.aclose()
            if not finished and not rejected:  # cancelled by the client, or failed mid-stream
                self._on_cancelled(times)

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

    def _on_finished(self, usage, times: _RequestTimes) -> None:
        m, label = self._metrics, self._model
        m.prompt_tokens.labels(label).inc(usage.prompt_tokens)
        m.e2e.labels(label).observe(time.monotonic() - times.start)
        decode_tokens = times.tokens - len(times.first_tokens)
        if decode_tokens > 0:
            m.tpot.labels(label).observe((times.last_token - times.first_token) / decode_tokens)
        if usage.queue_time_s is not None:
            m.queue_time.labels(label).observe(usage.queue_time_s)

    def _on_cancelled(self, times: _RequestTimes) -> None:
        m, label = self._metrics, self._model
        if times.open_completions > 0:
            m.request_success.labels(label, "abort").inc(times.open_completions)
        if times.first_token is not None:  # the prompt was prefilled
            m.prompt_tokens.labels(label).inc(times.num_prompt_tokens)
