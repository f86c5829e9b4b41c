"""Deadlines the scheduler keeps: refuse, before any prefill, what cannot finish in time.

A call's deadline (the gRPC deadline, the HTTP body's ``timeout``) reaches the engine as an absolute
``time.monotonic()`` second on :attr:`Request.deadline`. Within a priority the waiting queue is ordered earliest
deadline first (EDF; Liu & Layland, JACM 1973; a request without one sorts after every one with one). Before each
step, and when a request arrives, every waiting request that was never admitted is checked:

- its deadline has passed, or
- it cannot finish by it even if it started now (checked while requests run, so the step time is current, and
  only for a request that sets ``max_tokens``: the default cap is the room left in the context): ``now + (prefill
  steps + max_tokens) * step time * slowdown > deadline``, where the step time is the mean wall time of the
  executor's recent steps (:class:`StepTimer`; each step advances every running request by one token, and a
  prompt needs ``ceil(prompt / long_prefill_token_threshold)`` steps) and the slowdown how much longer recent
  admitted requests took than planned, with headroom (:attr:`DeadlinePolicy.slowdown`), or
- it has no deadline and has waited ``max_queue_time_s`` (``--max-queue-time-s``).

Such a request is refused with :class:`~pagedserve.errors.DeadlineError` (gRPC DEADLINE_EXCEEDED with a
``google.rpc.RetryInfo``, HTTP 504 with ``Retry-After``) carrying a retry hint: the estimated time until a running
request finishes and frees its seat. It has spent no prefill: only requests with no computed token are refused
(a preempted request, admitted once, runs on). Until a step has been measured only the first and last checks run.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ...errors import DeadlineError
from ...request import Request

STEP_WINDOW = 64   # steps the measured step time averages over
SLOWDOWN_WINDOW = 32   # admitted requests whose service time calibrates the estimate
SLOWDOWN_MIN_SAMPLES = 8
# beyond the learnt ratio: a burst of admissions slows the next requests before any of them ends. bench/deadlines.py
# (Zen 4, 3 arrival seeds at 2x and 3x overload): 1.1 let admitted calls miss in 3 of 6 runs (up to 6), 1.25 in none
SLOWDOWN_HEADROOM = 1.25
SLOWDOWN_TTL_S = 60.0     # a ratio older than this no longer counts: a burst's lesson is about that burst's load
SLOWDOWN_MAX = 3.0        # the learnt ratio at most: one stalled request must not refuse every later call


class StepTimer:
    """The measured step time: the mean wall seconds of the executor's last :data:`STEP_WINDOW` steps (prefill
    chunks and decodes alike: under load a request's decode steps carry other requests' prefill chunks too, so the
    mean over a window is its expected time per token; one slow step moves it by 1/64 of its excess)."""

    def __init__(self, window: int = STEP_WINDOW) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self.num_steps = 0

    @property
    def step_s(self) -> float | None:
        """Mean seconds per step over the window; None before the first step."""
        return self._sum / len(self._recent) if self._recent else None

    def observe(self, seconds: float) -> None:
        """One step took ``seconds`` (wall time of ``executor.execute``)."""
        if len(self._recent) == self._recent.maxlen:
            self._sum -= self._recent[0]
        self._recent.append(seconds)
        self._sum += seconds
        self.num_steps += 1


@dataclass
class DeadlineStats:
    """Counters for /metrics: refusals by reason, prefill tokens the refused requests had spent (0 by design),
    requests that finished after their deadline."""

    refused_expired: int = 0          # the deadline had passed before admission
    refused_infeasible: int = 0       # could not finish by the deadline at the measured step time
    refused_queue_time: int = 0       # no deadline, waited max_queue_time_s
    refused_prefill_tokens: int = 0
    missed: int = 0
    refused_by_caller: dict[str, int] = field(default_factory=dict)   # caller (fair shares) -> refusals, any reason


class DeadlinePolicy:
    """The checks above for one scheduler.

    Args:
        prefill_chunk: tokens one prefill step takes at most (the scheduler's ``long_prefill_token_threshold``).
        max_queue_time_s: waiting seconds at most for a request without a deadline (None: unbounded).
        enabled: False ignores deadlines (no refusal by deadline; EDF off): the baseline of bench/deadlines.py.
    """

    def __init__(self, prefill_chunk: int, max_queue_time_s: float | None = None, enabled: bool = True):
        self.prefill_chunk = max(1, prefill_chunk)
        self.max_queue_time_s = max_queue_time_s
        self.enabled = enabled
        self.timer = StepTimer()
        self.stats = DeadlineStats()
        # (monotonic second it ended, service time / estimate) of admitted requests that ended by themselves
        self._ratios: deque[tuple[float, float]] = deque(maxlen=SLOWDOWN_WINDOW)

    def steps_needed(self, prompt_tokens: int, output_tokens: int) -> int:
        """Steps from admission to the last of ``output_tokens``: the prompt's prefill chunks, then one step per
        further token."""
        return math.ceil(prompt_tokens / self.prefill_chunk) + max(0, output_tokens - 1)

    @property
    def slowdown(self) -> float:
        """How much longer admitted requests took than planned (:meth:`on_finished`): the largest ratio over the
        last :data:`SLOWDOWN_WINDOW` admitted requests that ended within :data:`SLOWDOWN_TTL_S` seconds of the
        latest check (1.0 until :data:`SLOWDOWN_MIN_SAMPLES` did), at most :data:`SLOWDOWN_MAX`, times
        :data:`SLOWDOWN_HEADROOM`. Old ratios age out because they describe the load of their time: a burst that
        slowed 32 requests 6x, learnt on a server that then went quiet, refused a feasible call minutes later
        (tests/e2e/test_faults.py in the full suite). It covers what the mean step misses: a request's own prefill step is
        longer than the mean, and requests admitted after it add their prompts to its steps (bench/deadlines.py:
        admitted requests take up to 1.25x the plain estimate in bursts, and the window learns a burst only as its
        requests end)."""
        worst = max(r for _, r in self._ratios) if len(self._ratios) >= SLOWDOWN_MIN_SAMPLES else 1.0
        return SLOWDOWN_HEADROOM * min(SLOWDOWN_MAX, worst)

    def _age_out(self, now: float) -> None:
        while self._ratios and now - self._ratios[0][0] > SLOWDOWN_TTL_S:
            self._ratios.popleft()

    def planned_service_s(self, request: Request) -> float | None:
        """The plain estimate of the seconds ``request`` needs from admission to its last token:
        :meth:`steps_needed` x the measured step time (None before the first measured step)."""
        if self.timer.step_s is None:
            return None
        steps = self.steps_needed(request.num_tokens - request.num_computed_tokens,
                                  request.max_tokens - request.num_output_tokens)
        return steps * self.timer.step_s

    def estimated_service_s(self, request: Request) -> float | None:
        """:meth:`planned_service_s` x :attr:`slowdown` (None before the first measured step)."""
        planned = self.planned_service_s(request)
        return None if planned is None else planned * self.slowdown

    def refusal(self, request: Request, now: float, running: list[Request]) -> DeadlineError | None:
        """The error to refuse a not-yet-admitted ``request`` with at ``now``, or None when it may still run
        (counted by reason and by ``request.caller``)."""
        self._age_out(now)
        error = self._refusal(request, now, running)
        if error is not None:
            by = self.stats.refused_by_caller
            by[request.caller] = by.get(request.caller, 0) + 1
        return error

    def _refusal(self, request: Request, now: float, running: list[Request]) -> DeadlineError | None:
        if request.num_computed_tokens > 0 or request.num_preemptions > 0:
            return None                   # admitted once: it runs on
        if request.deadline is None or not self.enabled:
            limit = self.max_queue_time_s
            if limit is not None and now - request.arrival_time >= limit:
                self.stats.refused_queue_time += 1
                return DeadlineError(f"waited {now - request.arrival_time:.1f} s in the queue "
                                     f"(--max-queue-time-s {limit:g}) without being scheduled",
                                     retry_after_s=self.retry_after_s(running))
            return None
        left = request.deadline - now
        if left <= 0:
            self.stats.refused_expired += 1
            return DeadlineError(f"the deadline passed after {now - request.arrival_time:.2f} s in the queue, "
                                 "before the request could be scheduled", retry_after_s=self.retry_after_s(running))
        # Only with an explicit max_tokens (the default, the room left in the context, is a cap that EOS usually
        # ends long before), and while requests run (an idle engine runs it at once, at its best speed).
        explicit = request.params.max_tokens is not None
        planned = self.planned_service_s(request) if running and explicit else None
        need = None
        if planned is not None:   # what on_finished compares the service time with: the last check's
            request.planned_service_s = planned
            need = planned * self.slowdown
        if need is not None and need > left:
            self.stats.refused_infeasible += 1
            return DeadlineError(
                f"cannot finish within the deadline: {request.num_prompt_tokens} prompt tokens and max_tokens "
                f"{request.max_tokens} need about {need:.2f} s at the measured {self.timer.step_s * 1e3:.1f} ms per "
                f"step, {left:.2f} s are left", retry_after_s=self.retry_after_s(running))
        return None

    def retry_after_s(self, running: list[Request]) -> float:
        """When a retry may find a seat: the estimated seconds until the running request closest to its end
        finishes (at least 1 s; 1 s before any step was measured)."""
        step = self.timer.step_s
        if step is None or not running:
            return 1.0
        left = min(max(0, r.max_tokens - r.num_output_tokens) for r in running)
        return max(1.0, left * step)

    def on_finished(self, request: Request, now: float, calibrate: bool = True) -> None:
        """Count a request that ended (any way) after its deadline; one that ran unpreempted from admission
        calibrates :attr:`slowdown`: its seconds from first step to ``now`` over the plain estimate of its last
        check before admission (``request.planned_service_s``, scaled to the tokens it made), else over its steps x
        the step time now. ``calibrate=False`` (aborted calls: the client or a fault ended them, at any point)
        only counts a miss."""
        if request.deadline is not None and now > request.deadline:
            self.stats.missed += 1
        start, step = request.first_scheduled_time, self.timer.step_s
        if calibrate and start is not None and step and request.num_preemptions == 0 and request.num_output_tokens > 0:
            # against the estimate made when it was admitted (the step time then), scaled to the tokens it made;
            # without one (admitted without a check), the plain estimate at the step time now
            steps = self.steps_needed(request.num_prompt_tokens, request.num_output_tokens)
            planned = request.planned_service_s
            full = self.steps_needed(request.num_prompt_tokens, request.max_tokens)
            expected = planned * steps / full if planned and full else steps * step
            self._ratios.append((now, (now - start) / expected))

    @staticmethod
    def queue_key(request: Request) -> float:
        """The EDF part of the waiting queue's order: the deadline, +inf without one."""
        return request.deadline if request.deadline is not None else math.inf
