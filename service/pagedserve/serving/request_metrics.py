"""Per-request metrics, recorded by the request pipeline (:mod:`.pipeline`) as a request's deltas stream out.

Per request:

- ``generation_tokens`` as tokens stream out, ``prompt_tokens`` from the final usage;
- ``request_success{finished_reason}`` once per completion (``n`` per request), "abort" included;
- one sample each of TTFT (call to first token), TPOT ((last token - first token) / tokens after each
  completion's first), end-to-end latency (call to last delta) and queue time
  (``Usage.queue_time_s``: arrival to first scheduling, the engine's monotonic clock).

A request the client cancels counts as finished with "abort" and gives no latency samples; one refused before it
ran (validation, queue full, duplicate id) counts nothing but what it streamed.
"""
from __future__ import annotations

import time

from .metrics import ServerMetrics


class _RequestTimes:
    """What one request's stream has shown so far (monotonic seconds)."""

    __slots__ = ("start", "first_token", "last_token", "tokens", "first_tokens", "open_completions",
                 "num_prompt_tokens", "finished")

    def __init__(self, start: float, n: int, num_prompt_tokens: int):
        self.num_prompt_tokens = num_prompt_tokens  # as sent (before truncate_prompt_tokens)
        self.start = start
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.tokens = 0                  # over all completions
        self.first_tokens: set[int] = set()  # completions that produced their first token
        self.open_completions = n
        self.finished = False            # the final usage has arrived


class RequestMetrics:
    """Records the metrics of the requests of one served model.

    Args:
        metrics: the server's metrics.
        model_name: their ``model_name`` label.
    """

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self._metrics = metrics
        self._model = model_name

    def start(self, n: int, num_prompt_tokens: int) -> _RequestTimes:
        """A request of ``n`` completions is sent to the engine now; pass what this returns to the other calls."""
        return _RequestTimes(time.monotonic(), n, num_prompt_tokens)

    def on_delta(self, delta, times: _RequestTimes) -> None:
        """One delta of the request streamed out (its final usage included)."""
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
        if delta.usage is not None:
            times.finished = True
            self._on_finished(delta.usage, times)

    def on_end(self, times: _RequestTimes, refused: bool) -> None:
        """The request's stream has ended; ``refused``: it failed before producing a token (nothing to count)."""
        if times.finished or (refused and times.first_token is None):
            return
        m, label = self._metrics, self._model   # cancelled by the client, or failed mid-stream
        if times.open_completions > 0:
            m.request_success.labels(label, "abort").inc(times.open_completions)
        if times.first_token is not None:  # the prompt was prefilled
            m.prompt_tokens.labels(label).inc(times.num_prompt_tokens)

    def _on_finished(self, usage, times: _RequestTimes) -> None:
        m, label = self._metrics, self._model
        m.prompt_tokens.labels(label).inc(usage.prompt_tokens)
        m.e2e.labels(label).observe(time.monotonic() - times.start)
        decode_tokens = times.tokens - len(times.first_tokens)
        if decode_tokens > 0:
            m.tpot.labels(label).observe((times.last_token - times.first_token) / decode_tokens)
        if usage.queue_time_s is not None:
            m.queue_time.labels(label).observe(usage.queue_time_s)
