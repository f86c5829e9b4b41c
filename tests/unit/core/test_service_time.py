"""The service time estimate the deadline policy admits by (core/sched/service_time.py), on plain values and a fake
clock: the step time model (decode rows, further tokens) fitted from observed steps, the followers a request's
steps will carry, and the policy on a simulated batch under 3x overload: admitted requests all meet their deadline
(the estimate is an upper bound of their service when the step time is what the model says), and while the machine
runs slower than measured the hold keeps the admitted ones in time where admitting on would not."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedserve.core.sched.deadlines import DeadlinePolicy
from pagedserve.core.sched.service_time import BatchLoad, StepCost, steps_needed
from pagedserve.errors import DeadlineError
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

PROMPT, OUTPUT, SEATS = 64, 32, 8


def step_s(rows: int, tokens: int) -> float:
    """The fake executor: 2.9 ms + 1.14 ms a row + 1.8 ms a further token (about bench/deadlines.py's CPU: 12 ms
    for 8 decoding rows, 114 ms more for a 64-token prompt)."""
    return 0.0029 + 0.00114 * rows + 0.0018 * (tokens - rows)


def request(rid: str, prompt: int = PROMPT, max_tokens: int = OUTPUT, deadline: float | None = None,
            arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   eos_token_ids=frozenset(), deadline=deadline, arrival_time=arrival)


def decoding(rid: str, steps_left: int, deadline: float | None = None) -> Request:
    """A running request past its prompt with ``steps_left`` tokens to go."""
    r = request(rid, deadline=deadline)
    r.token_ids.extend([7] * (OUTPUT - steps_left))
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_the_step_cost_separates_decode_rows_from_prompt_tokens():
    cost = StepCost()
    for rows in (1, 3, 5, 8, 8, 2):
        cost.observe(step_s(rows, rows), rows, rows)
    for rows, tokens in ((1, 64), (8, 71), (4, 131)):
        cost.observe(step_s(rows, tokens), rows, tokens)
    assert cost.decode_s(8) == pytest.approx(step_s(8, 8))
    assert cost.token_s == pytest.approx(0.0018)


def test_the_step_cost_without_spread_or_without_prompts():
    cost = StepCost()
    cost.observe(0.064, 1, 64)                       # the first step: a prompt alone, nothing to tell rows apart
    assert cost.decode_s(8) == pytest.approx(0.008) and cost.token_s == pytest.approx(0.001)   # all alike
    for _ in range(3):
        cost.observe(0.016, 8, 8)                    # rows that did not vary: a line through the origin
    assert cost.decode_s(8) == pytest.approx(0.016) and cost.decode_s(4) == pytest.approx(0.008)
    assert cost.token_s == pytest.approx((0.064 - 0.002) / 63)
    fresh = StepCost()
    assert not fresh.ready
    fresh.observe(0.01, 5, 5)
    assert fresh.ready and fresh.token_s == pytest.approx(0.002)   # no prompt measured: a token costs a row


def test_followers_take_the_seats_freed_during_the_steps():
    running = [decoding("a", 4), decoding("b", 20), decoding("c", 30)]
    cost = StepCost()
    cost.observe(0.010, 4, 4)
    load = BatchLoad(running, max_num_seqs=5, prefill_chunk=64, cost=cost)
    assert load.remaining == [4, 20, 30] and load.empty_seats == 2 and load.prefill_left == 0
    assert load.follower_prompt == 63 and load.follower_steps == steps_needed(64, 32, 64) == 32
    # 24 steps: one empty seat filled now (the other is the request's own), a's seat at 4, b's at 20; c outlasts
    assert load.followers(24, empty_seats=1) == 3
    # 40 steps: the followers of the empty seat and of a end within them (a second one each), c's seat frees at 30
    assert load.followers(40, empty_seats=1) == 6
    # 24 steps x 12.5 ms (5 seats busy at 2.5 ms a row: the line through the origin) + (63 own + 3 x 63) x 2.5 ms
    # (no prompt measured: a further token costs a row)
    assert load.service_s(24, 64, joins=True) == pytest.approx(24 * 0.0125 + 4 * 63 * 0.0025)


def test_the_estimate_counts_the_prompts_that_will_join_its_steps():
    """Steps x the mean measured step (the estimate before) is 32 x 30 ms x 1.1 = 1.07 s here. But seven
    running requests end within its 32 steps and their seats take new prompts, 113 ms each: the estimate counts
    them (1.29 s before the headroom), and a request with 1.2 s left is refused."""
    p = DeadlinePolicy(prefill_chunk=64, max_num_seqs=SEATS)
    for rows in (8, 7, 8, 6, 8):
        p.observe_step(step_s(rows, rows), rows, rows)
    p.observe_step(step_s(8, 71), 8, 71)
    running = [decoding(f"r{i}", 4 * i + 2) for i in range(7)]
    r = request("new", deadline=1.2)
    planned = 32 * step_s(8, 8) + 8 * 63 * 0.0018          # its prompt and 7 followers'
    assert p.estimated_service_s(r, running) == pytest.approx(planned * 1.1)
    assert 32 * p.timer.step_s * 1.1 < 1.2 < planned       # fits the mean step, not the batch it runs in
    assert isinstance(p.refusal(r, 0.0, running), DeadlineError)
    assert r.planned_service_s == pytest.approx(planned)


def test_a_newcomer_waits_while_a_running_request_is_behind():
    p = DeadlinePolicy(prefill_chunk=64, max_num_seqs=SEATS)
    for rows in (8, 6):
        p.observe_step(step_s(rows, rows), rows, rows)
    p.observe_step(step_s(7, 70), 7, 70)
    # 10 steps left, 7 seats free: 10 x 12 ms and 7 x 63 prompt tokens at 1.8 ms reserved, 1.0 s with the headroom
    on_time = decoding("fine", 10, deadline=2.0)
    assert not p.holds(request("new"), [on_time], now=0.0)
    assert p.holds(request("long", prompt=1000), [on_time], now=0.0)   # 921 tokens more than the one reserved
    behind = decoding("behind", 10, deadline=0.5)          # 52 ms alone, 0.88 s with 6 followers and the headroom
    assert p.holds(request("new"), [on_time, behind], now=0.0)
    lost = decoding("lost", 10, deadline=0.04)             # late even if nothing more is admitted
    assert not p.holds(request("new"), [on_time, lost], now=0.0)
    assert not DeadlinePolicy(64, enabled=False, max_num_seqs=SEATS).holds(request("new"), [behind], now=0.0)


def simulate(policy: DeadlinePolicy, arrivals: list[float], slack_s: float, slower=lambda now: 1.0,
             hold: bool = True) -> tuple[Counter, list[float]]:
    """The engine loop on a fake clock (bench/deadlines.py's workload): requests arrive at ``arrivals``, each with
    a deadline ``slack_s`` later; the caller cancels at the deadline; refusal at arrival and before each step,
    admission in deadline order while seats are free (and the policy does not hold, with ``hold``); a step costs
    :func:`step_s` x ``slower(now)``. Returns the counts and each finished request's service / planned."""
    now, waiting, running, out, ratios = 0.0, [], [], Counter(), []
    i = 0
    while i < len(arrivals) or waiting or running:
        if not waiting and not running:
            now = max(now, arrivals[i])
        while i < len(arrivals) and arrivals[i] <= now:
            r = request(f"r{i}", deadline=arrivals[i] + slack_s, arrival=arrivals[i])
            i += 1
            if policy.refusal(r, now, running) is None:
                waiting.append(r)
            else:
                out["refused"] += 1
        for r in [r for r in running if r.deadline <= now]:
            running.remove(r)
            policy.on_finished(r, now)
            out["cancelled"] += 1
        load = policy.load(running)
        for r in [r for r in waiting if r.deadline <= now or policy.refusal(r, now, running, load) is not None]:
            waiting.remove(r)
            out["refused" if r.deadline > now else "cancelled_waiting"] += 1
        while waiting and len(running) < SEATS and not (hold and policy.holds(waiting[0], running, now)):
            waiting[0].first_scheduled_time = now
            running.append(waiting.pop(0))
        if not running:
            continue
        tokens = sum(r.num_tokens - r.num_computed_tokens for r in running)   # a prompt is one chunk
        seconds = step_s(len(running), tokens) * slower(now)
        now += seconds
        policy.observe_step(seconds, len(running), tokens)
        for r in list(running):
            r.num_computed_tokens = r.num_tokens
            r.append_output_token(7)
            if r.num_output_tokens == r.max_tokens:
                running.remove(r)
                policy.on_finished(r, now)
                out["in_time" if now <= r.deadline else "late"] += 1
                if r.planned_service_s is not None:            # None: admitted into an idle engine, unchecked
                    ratios.append((now - r.first_scheduled_time) / r.planned_service_s)
    return out, ratios


def overload(factor: float, seconds: float, seed: int) -> tuple[list[float], float]:
    """Poisson arrivals at ``factor`` x the capacity (a batch of 8 together takes ``batch_s``), and batch_s."""
    batch_s = step_s(SEATS, SEATS * PROMPT) + (OUTPUT - 1) * step_s(SEATS, SEATS)
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(factor * SEATS / batch_s)) < seconds:
        out.append(t)
    return out, batch_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_under_3x_overload_every_admitted_request_meets_its_deadline(seed):
    arrivals, batch_s = overload(3.0, 20.0, seed)
    out, ratios = simulate(DeadlinePolicy(PROMPT, max_num_seqs=SEATS), arrivals, 2.5 * batch_s)
    assert out["late"] == out["cancelled"] == out["cancelled_waiting"] == 0
    assert out["refused"] > len(arrivals) / 2
    assert out["in_time"] >= 0.95 * 20.0 / batch_s * SEATS          # the seats kept full: about the capacity
    assert max(ratios) <= 1.0 + 1e-9                               # the estimate bounds the service


def test_while_the_machine_runs_slower_the_hold_keeps_admitted_requests_in_time():
    """Steps 30% slower than measured for 2 s: requests admitted at the margin of their estimate run late unless
    prompts stop joining their steps while they are behind."""
    arrivals, batch_s = overload(3.0, 20.0, 0)
    slower = lambda now: 1.3 if 8.0 <= now < 10.0 else 1.0        # noqa: E731
    held, _ = simulate(DeadlinePolicy(PROMPT, max_num_seqs=SEATS), arrivals, 2.5 * batch_s, slower)
    admitted_on, _ = simulate(DeadlinePolicy(PROMPT, max_num_seqs=SEATS), arrivals, 2.5 * batch_s, slower,
                              hold=False)
    assert held["late"] + held["cancelled"] == 0 < admitted_on["late"] + admitted_on["cancelled"]
    assert held["in_time"] >= admitted_on["in_time"]
