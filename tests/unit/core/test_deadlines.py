"""Deadline scheduling (core/sched/deadlines.py) on plain values: earliest deadline first within a priority, the
refusal rules (expired, infeasible at the measured step time, --max-queue-time-s), never a request admitted once,
the retry hint, and the scheduler's sweep of its waiting queue."""
from __future__ import annotations

import math

import pytest

from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.sched.deadlines import SLOWDOWN_HEADROOM as H
from pagedserve.core.sched.deadlines import DeadlinePolicy, StepTimer
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.errors import DeadlineError
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from sched_cases import schedule, worker_output

NOW = 1000.0


def req(rid: str, n_prompt: int = 4, max_tokens: int = 8, priority: int = 0, deadline: float | None = None,
        arrival: float = NOW) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 40)
    return Request(rid, list(range(base + 1, base + n_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens,
                   eos_token_ids=frozenset(), priority=priority, deadline=deadline, arrival_time=arrival)


def admission_order(s: Scheduler, count: int) -> list[str]:
    """Admit one request per step (max_num_seqs=1 and each finishes in one step) and return the order."""
    order = []
    for _ in range(count):
        step = schedule(s)
        admitted = step.scheduled[0].request
        order.append(admitted.request_id)
        s.update_from_output(step.output, worker_output(step))
        s.finish(admitted, RequestStatus.FINISHED_STOPPED)
    return order


def test_earliest_deadline_first_within_a_priority():
    s = Scheduler(KVCacheManager(64, 16), max_num_seqs=1, max_num_batched_tokens=64)
    for r in (req("none-early-arrival", arrival=NOW - 5), req("late", deadline=NOW + 30),
              req("soon", deadline=NOW + 10), req("urgent-low-priority", priority=1, deadline=NOW + 1),
              req("none", arrival=NOW)):
        s.add_request(r)
    assert admission_order(s, 5) == ["soon", "late", "none-early-arrival", "none", "urgent-low-priority"]


def test_deadlines_ignored_keep_arrival_order():
    s = Scheduler(KVCacheManager(64, 16), 1, 64, deadlines=DeadlinePolicy(64, enabled=False))
    for i, d in enumerate((NOW + 30, NOW + 10, None)):
        s.add_request(req(f"r{i}", deadline=d, arrival=NOW + i))
    assert admission_order(s, 3) == ["r0", "r1", "r2"]


def test_refusal_rules():
    p = DeadlinePolicy(prefill_chunk=64)
    assert p.refusal(req("a", deadline=NOW + 1), NOW, []) is None        # nothing measured: only expiry counts
    err = p.refusal(req("b", deadline=NOW - 0.1), NOW, [])
    assert isinstance(err, DeadlineError) and "deadline passed" in str(err) and err.retry_after_s == 1.0
    p.timer.observe(0.1)                                                  # 100 ms per step
    # 130 prompt tokens = 3 prefill steps, then 7 more decode steps: 10 steps = 1.0 s, H s with the headroom
    assert p.estimated_service_s(req("c", n_prompt=130, max_tokens=8)) == pytest.approx(H)
    busy = [req("running")]
    assert p.refusal(req("c", n_prompt=130, max_tokens=8, deadline=NOW + H + 0.05), NOW, busy) is None
    assert p.refusal(req("d", n_prompt=130, max_tokens=8, deadline=NOW + 1.05), NOW, []) is None  # idle: runs now
    err = p.refusal(req("d", n_prompt=130, max_tokens=8, deadline=NOW + 1.05), NOW, busy)
    assert isinstance(err, DeadlineError) and "cannot finish within the deadline" in str(err)
    assert (p.stats.refused_expired, p.stats.refused_infeasible, p.stats.refused_queue_time) == (1, 1, 0)
    assert p.stats.refused_by_caller == {"": 2}                          # per caller (fair shares' name)
    named = req("e", deadline=NOW - 1)
    named.caller = "team-a"
    assert p.refusal(named, NOW, busy) is not None and p.stats.refused_by_caller == {"": 2, "team-a": 1}


def test_a_request_admitted_once_is_never_refused():
    p = DeadlinePolicy(64)
    started = req("s", deadline=NOW - 1)
    started.num_computed_tokens = 2
    preempted = req("p", deadline=NOW - 1)
    preempted.num_preemptions = 1
    assert p.refusal(started, NOW, []) is None and p.refusal(preempted, NOW, []) is None


def test_max_queue_time_for_requests_without_a_deadline():
    p = DeadlinePolicy(64, max_queue_time_s=5)
    assert p.refusal(req("young", arrival=NOW - 4.9), NOW, []) is None
    err = p.refusal(req("old", arrival=NOW - 5), NOW, [])
    assert isinstance(err, DeadlineError) and "--max-queue-time-s 5" in str(err)
    assert p.stats.refused_queue_time == 1
    assert DeadlinePolicy(64).refusal(req("old", arrival=NOW - 1e6), NOW, []) is None  # no limit by default


def test_retry_hint_is_the_nearest_seat():
    p = DeadlinePolicy(64)
    p.timer.observe(0.5)
    a, b = req("a", max_tokens=30), req("b", max_tokens=10)
    b.token_ids += [1, 2]   # 2 of 10 generated: 8 steps left
    assert p.retry_after_s([a, b]) == pytest.approx(4.0)
    assert p.retry_after_s([]) == 1.0


def test_step_timer_is_a_windowed_mean():
    t = StepTimer(window=3)
    assert t.step_s is None
    for seconds in (1.0, 2.0, 3.0, 7.0):
        t.observe(seconds)
    assert t.step_s == pytest.approx(4.0) and t.num_steps == 4   # the last three


def test_the_scheduler_sweep_finds_only_late_waiting_requests():
    s = Scheduler(KVCacheManager(64, 16), 1, 64)
    running = req("running", deadline=NOW - 10)
    s.add_request(running)
    schedule(s)                                          # admitted: never swept
    fine, late, plain = req("fine", deadline=NOW + 100), req("late", deadline=NOW - 1), req("plain")
    for r in (fine, late, plain):
        s.add_request(r)
    found = s.late_waiting(NOW)
    assert [r.request_id for r, _ in found] == ["late"] and isinstance(found[0][1], DeadlineError)
    assert math.isinf(DeadlinePolicy.queue_key(plain))


def test_without_an_explicit_max_tokens_only_expiry_counts():
    p = DeadlinePolicy(64)
    p.timer.observe(1.0)
    r = Request("d", [1, 2, 3], SamplingParams(), max_tokens=8000, eos_token_ids=frozenset(), deadline=NOW + 5)
    assert p.refusal(r, NOW, [req("running")]) is None     # max_tokens is the context's room: no estimate


def test_the_estimate_is_calibrated_by_how_long_admitted_requests_took():
    """Admitted requests that took twice steps x the mean step time (their own prefill steps are longer, later
    prompts join their steps) double the estimate once 8 have ended, so a request that fits the plain estimate
    but not the calibrated one is refused; preempted ones do not count."""
    p = DeadlinePolicy(prefill_chunk=64)
    p.timer.observe(0.1)
    busy = [req("running")]
    probe = req("probe", n_prompt=60, max_tokens=10, deadline=NOW + 1.5)   # 10 steps: H s before calibration, 2H after
    assert p.estimated_service_s(probe) == pytest.approx(H) and p.refusal(probe, NOW, busy) is None
    for i in range(8):
        done = req(f"done{i}", n_prompt=60, max_tokens=5)
        done.token_ids.extend([7] * 5)
        done.first_scheduled_time = NOW - 1.0             # 5 steps at 0.1 s would be 0.5 s: it took 1.0 s
        if i == 0:
            done.num_preemptions = 1
        p.on_finished(done, NOW)
    assert p.slowdown == pytest.approx(H)                 # 7 samples: the preempted one is left out; headroom
    extra = req("done8", n_prompt=60, max_tokens=5)
    extra.token_ids.extend([7] * 5)
    extra.first_scheduled_time = NOW - 1.0
    p.on_finished(extra, NOW)
    assert p.slowdown == pytest.approx(2 * H)             # the slowest, with the headroom
    assert p.estimated_service_s(probe) == pytest.approx(2 * H)
    assert isinstance(p.refusal(probe, NOW, busy), DeadlineError)


def test_the_calibration_compares_with_the_estimate_made_at_admission():
    """Requests planned at 0.1 s per step that took 2x as long while the mean step rose to 0.2 s: measured against
    their admission-time estimate (not the step time at their end) the slowdown is 2, not 1."""
    p = DeadlinePolicy(prefill_chunk=64)
    p.timer.observe(0.1)
    busy = [req("running")]
    done = []
    for i in range(8):
        r = req(f"d{i}", n_prompt=60, max_tokens=10, deadline=NOW + 100)
        assert p.refusal(r, NOW, busy) is None
        assert r.planned_service_s == pytest.approx(1.0)       # 10 steps at 0.1 s, before any slowdown
        done.append(r)
    for _ in range(64):
        p.timer.observe(0.2)                                   # the engine slowed down after they were admitted
    for r in done:
        r.token_ids.extend([7] * 10)
        r.first_scheduled_time = NOW - 2.0
        p.on_finished(r, NOW)
    assert p.slowdown == pytest.approx(2.0 * H)


def _learn(p: DeadlinePolicy, ratio: float, at: float, n: int = 8) -> None:
    """``n`` admitted requests of 5 steps at 0.1 s that ended at ``at`` after ``ratio`` x their plain estimate."""
    for i in range(n):
        done = req(f"slow{i}", n_prompt=60, max_tokens=5)
        done.token_ids.extend([7] * 5)
        done.first_scheduled_time = at - 0.5 * ratio
        p.on_finished(done, at)


def test_the_calibration_ages_out_and_is_capped():
    """A burst that made 8 requests take 7x their estimate (as a shared test server saw) neither refuses a call
    after SLOWDOWN_TTL_S nor, while it counts, raises the estimate beyond SLOWDOWN_MAX x headroom."""
    from pagedserve.core.sched.deadlines import SLOWDOWN_MAX, SLOWDOWN_TTL_S
    p = DeadlinePolicy(prefill_chunk=64)
    p.timer.observe(0.1)
    busy = [req("running")]
    _learn(p, ratio=7.0, at=NOW)
    assert p.slowdown == pytest.approx(SLOWDOWN_MAX * H)
    probe = req("probe", n_prompt=10, max_tokens=100, deadline=NOW + 20)   # 100 steps: 10 s plain, 33 s at the cap
    assert isinstance(p.refusal(probe, NOW + 1, busy), DeadlineError)
    later = NOW + SLOWDOWN_TTL_S + 1
    probe.deadline = later + 20
    assert p.refusal(probe, later, busy) is None and p.slowdown == pytest.approx(H)


def test_aborted_calls_count_as_misses_but_do_not_calibrate():
    p = DeadlinePolicy(prefill_chunk=64)
    p.timer.observe(0.1)
    for i in range(8):
        done = req(f"ab{i}", n_prompt=60, max_tokens=5, deadline=NOW - 1)
        done.token_ids.extend([7] * 5)
        done.first_scheduled_time = NOW - 10.0              # 20x its estimate
        p.on_finished(done, NOW, calibrate=False)
    assert p.stats.missed == 8 and p.slowdown == pytest.approx(H)
