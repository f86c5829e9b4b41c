"""Deadlines the scheduler keeps: refuse, before any prefill, what cannot finish in time; admit nothing that would
make an admitted request miss its deadline.

A call's deadline (the gRPC deadline, the HTTP body's ``timeout``) reaches the engine as an absolute
``time.monotonic()`` second on :attr:`Request.deadline`. Within a priority the waiting queue is ordered earliest
deadline first (EDF; Liu & Layland, JACM 1973; a request without one sorts after every one with one). Before each
step, and when a request arrives, every waiting request that was never admitted is checked:

- its deadline has passed, or
- it cannot finish by it even if it started now (checked while requests run, so the step time is current, and
  only for a request that sets ``max_tokens``: the default cap is the room left in the context): ``now + service *
  slowdown > deadline``, where the service time is estimated at the batch it would run in
  (:meth:`.service_time.BatchLoad.service_s`: every seat busy, the prompts of the requests that will take the seats
  freed during its steps reserved, at the step time model fitted on the executor's recent steps) and the slowdown
  is how much longer recent admitted requests took than estimated, with headroom (:attr:`DeadlinePolicy.slowdown`),
  or
- it has no deadline and has waited ``max_queue_time_s`` (``--max-queue-time-s``).

Such a request is refused with :class:`~pagedserve.errors.DeadlineError` (gRPC DEADLINE_EXCEEDED with a
``google.rpc.RetryInfo``, HTTP 504 with ``Retry-After``) carrying a retry hint: the estimated time until a running
request finishes and frees its seat. It has spent no prefill: only requests with no computed token are refused
(a preempted request, admitted once, runs on). Until a step has been measured only the first and last checks run.

The estimate can still fall short after admission (the machine slows down, a prompt larger than the reserved one
joins), so the scheduler also asks, before it admits a waiting request, whether that would make a running request
miss a deadline it can still meet (:meth:`DeadlinePolicy.holds`); if so the waiting request waits (and is refused
later, before any prefill, if it can no longer finish): prompts joining a batch are what slow its requests most.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from ...errors import DeadlineError
from ...request import Request
from .service_time import BatchLoad, StepCost, further_tokens, remaining_steps, steps_needed

STEP_WINDOW = 64   # steps the measured step time averages over
SLOWDOWN_WINDOW = 32   # admitted requests whose service time calibrates the estimate
SLOWDOWN_MIN_SAMPLES = 8
SLOWDOWN_HEADROOM = 1.1   # beyond the slowest ratio: what the window has not seen yet


class StepTimer:
    """The mean wall seconds of the executor's last :data:`STEP_WINDOW` steps (prefill chunks and decodes alike),
    for the retry hint and the refusal's message (the estimate uses :class:`.service_time.StepCost`)."""

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
        enabled: False ignores deadlines (no refusal by deadline; EDF off, no hold): the baseline of
            bench/deadlines.py.
        max_num_seqs: the scheduler's seats (the batch a request runs in).
    """

    def __init__(self, prefill_chunk: int, max_queue_time_s: float | None = None, enabled: bool = True,
                 max_num_seqs: int = 1):
        self.prefill_chunk = max(1, prefill_chunk)
        self.max_queue_time_s = max_queue_time_s
        self.enabled = enabled
        self.max_num_seqs = max(1, max_num_seqs)
        self.timer = StepTimer()
        self.cost = StepCost()
        self.stats = DeadlineStats()
        self._ratios: deque[float] = deque(maxlen=SLOWDOWN_WINDOW)   # service time / estimate, admitted requests

    def steps_needed(self, prompt_tokens: int, output_tokens: int) -> int:
        """:func:`.service_time.steps_needed` at this policy's prefill chunk."""
        return steps_needed(prompt_tokens, output_tokens, self.prefill_chunk)

    def observe_step(self, seconds: float, rows: int, tokens: int) -> None:
        """The executor ran a step of ``rows`` requests and ``tokens`` tokens in ``seconds``."""
        self.timer.observe(seconds)
        self.cost.observe(seconds, rows, tokens)

    @property
    def slowdown(self) -> float:
        """How much longer admitted requests took than estimated (:meth:`on_finished`): the largest ratio over the
        last :data:`SLOWDOWN_WINDOW` admitted requests that ended, at least 1 (1 until :data:`SLOWDOWN_MIN_SAMPLES`
        did; a ratio below 1 is load reserved that did not come, not an error of the model to take back), times
        :data:`SLOWDOWN_HEADROOM`. It covers what the step time model misses (a step's cost is not linear in its
        prompts; the driver's time between steps) and a machine that runs slower than the steps it was fitted on."""
        worst = max(self._ratios) if len(self._ratios) >= SLOWDOWN_MIN_SAMPLES else 1.0
        return SLOWDOWN_HEADROOM * max(1.0, worst)

    def load(self, running: list[Request]) -> BatchLoad | None:
        """The running batch for the estimates; None while nothing runs (an idle engine runs a request at once, at
        its best speed) or before the first measured step."""
        if not running or not self.cost.ready:
            return None
        return BatchLoad(running, self.max_num_seqs, self.prefill_chunk, self.cost)

    def planned_service_s(self, request: Request, load: BatchLoad | None) -> float | None:
        """The estimate, before the slowdown, of the seconds a waiting ``request`` needs from admission to its last
        token at ``load`` (:meth:`.service_time.BatchLoad.service_s`; None without a load)."""
        if load is None:
            return None
        return load.service_s(remaining_steps(request, self.prefill_chunk),
                              request.num_tokens - request.num_computed_tokens, joins=True)

    def estimated_service_s(self, request: Request, running: list[Request]) -> float | None:
        """:meth:`planned_service_s` x :attr:`slowdown` beside ``running`` (None while nothing runs or before the
        first measured step)."""
        planned = self.planned_service_s(request, self.load(running))
        return None if planned is None else planned * self.slowdown

    def refusal(self, request: Request, now: float, running: list[Request],
                load: BatchLoad | None = None) -> DeadlineError | None:
        """The error to refuse a not-yet-admitted ``request`` with at ``now``, or None when it may still run
        (counted by reason and by ``request.caller``). ``load``: ``self.load(running)``, when the caller checks
        many requests against one batch."""
        error = self._refusal(request, now, running, load)
        if error is not None:
            by = self.stats.refused_by_caller
            by[request.caller] = by.get(request.caller, 0) + 1
        return error

    def _refusal(self, request: Request, now: float, running: list[Request],
                 load: BatchLoad | None) -> DeadlineError | None:
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
        if request.params.max_tokens is None or not running:
            return None
        planned = self.planned_service_s(request, load or self.load(running))
        if planned is None:
            return None
        request.planned_service_s = planned   # what on_finished compares the service time with: the last check's
        need = planned * self.slowdown
        if need > left:
            self.stats.refused_infeasible += 1
            return DeadlineError(
                f"cannot finish within the deadline: {request.num_prompt_tokens} prompt tokens and max_tokens "
                f"{request.max_tokens} need about {need:.2f} s beside the {len(running)} running requests "
                f"(mean step {self.timer.step_s * 1e3:.1f} ms), {left:.2f} s are left",
                retry_after_s=self.retry_after_s(running))
        return None

    def holds(self, newcomer: Request, running: list[Request], now: float | None = None) -> bool:
        """Whether admitting the waiting ``newcomer`` at ``now`` (None: the clock now) must wait: some running
        request with a deadline (and an explicit max_tokens) that it would still meet if nothing more were admitted
        (its remaining steps at the running batch, no slowdown) would miss it at the load reserved for it (the
        newcomer's prompt in place of the one reserved for the seat it takes), times :attr:`slowdown`. A request
        admitted at the margin of its estimate holds admissions only once it runs slower than estimated by more
        than the slowdown; one late whatever happens holds nothing."""
        if not self.enabled or not running or not self.cost.ready:
            return False
        watched = [r for r in running if r.deadline is not None and r.params.max_tokens is not None]
        if not watched:
            return False
        now = time.monotonic() if now is None else now
        load = BatchLoad(running, self.max_num_seqs, self.prefill_chunk, self.cost)
        token_s, alone_step_s, slowdown = self.cost.token_s, self.cost.decode_s(len(running)), self.slowdown
        own = further_tokens(newcomer.num_tokens - newcomer.num_computed_tokens, self.prefill_chunk)
        extra_s = max(0.0, own - load.follower_prompt) * token_s
        for r in watched:
            left, steps = r.deadline - now, remaining_steps(r, self.prefill_chunk)
            if steps * alone_step_s + load.prefill_left * token_s > left:
                continue                                         # late whatever waits
            if (load.service_s(steps, 0, joins=False) + extra_s) * slowdown > left:
                return True
        return False

    def retry_after_s(self, running: list[Request]) -> float:
        """When a retry may find a seat: the estimated seconds until the running request closest to its end
        finishes (at least 1 s; 1 s before any step was measured)."""
        step = self.timer.step_s
        if step is None or not running:
            return 1.0
        left = min(max(0, r.max_tokens - r.num_output_tokens) for r in running)
        return max(1.0, left * step)

    def on_finished(self, request: Request, now: float) -> None:
        """Count a request that ended (any way) after its deadline; one that ran unpreempted from admission
        calibrates :attr:`slowdown`: its seconds from first step to ``now`` over the plain estimate of its last
        check before admission (``request.planned_service_s``, scaled to the tokens it made), else over its steps x
        the step time now."""
        if request.deadline is not None and now > request.deadline:
            self.stats.missed += 1
        start, step = request.first_scheduled_time, self.timer.step_s
        if start is not None and step and request.num_preemptions == 0 and request.num_output_tokens > 0:
            # against the estimate made when it was admitted (the step time then), scaled to the tokens it made;
            # without one (admitted without a check), the plain estimate at the step time now
            steps = self.steps_needed(request.num_prompt_tokens, request.num_output_tokens)
            planned = request.planned_service_s
            full = self.steps_needed(request.num_prompt_tokens, request.max_tokens)
            expected = planned * steps / full if planned and full else steps * step
            self._ratios.append((now - start) / expected)

    @staticmethod
    def queue_key(request: Request) -> float:
        """The EDF part of the waiting queue's order: the deadline, +inf without one."""
        return request.deadline if request.deadline is not None else math.inf
