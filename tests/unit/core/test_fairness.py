"""Fair shares (core/sched/fairness.py): the virtual token counter's lift, pick and weights on plain values, and
through the scheduler: a light caller's requests are admitted ahead of a heavy caller's backlog, nothing changes
without caller names, and weights set the token shares (within 10%)."""
from __future__ import annotations

import pytest

from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.sched.fairness import DECODE_COST, PREFILL_COST, VirtualTokenCounter
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from sched_cases import schedule, worker_output

_ids = iter(range(10**6))


def req(caller: str, n_prompt: int = 8, max_tokens: int = 8) -> Request:
    base = 100 * next(_ids)   # distinct prompts: no prefix-cache sharing
    return Request(f"{caller}-{base}", list(range(base + 1, base + n_prompt + 1)), SamplingParams(),
                   max_tokens=max_tokens, eos_token_ids=frozenset(), caller=caller)


def test_counters_charge_weighted_tokens_and_lift_a_returning_caller():
    vtc = VirtualTokenCounter({"b": 2})
    vtc.on_arrival("a")
    vtc.charge("a", prefill_tokens=10, decode_tokens=5)
    assert vtc.counters["a"] == pytest.approx(10 * PREFILL_COST + 5 * DECODE_COST)
    vtc.on_arrival("b")                    # joins while a is backlogged: lifted to a's counter
    assert vtc.counters["b"] == vtc.counters["a"]
    vtc.charge("b", 10, 5)
    assert vtc.counters["b"] - vtc.counters["a"] == pytest.approx((10 + 10) / 2)  # weight 2: half the cost
    vtc.on_leave("a")
    vtc.charge("b", 100, 0)
    vtc.on_arrival("a")                    # back after idling: no banked credit below the backlogged minimum
    assert vtc.counters["a"] == vtc.counters["b"]
    assert vtc.pick([("b", "first-b"), ("a", "first-a"), ("a", "second-a")]) == "first-b"  # equal: queue order


@pytest.mark.parametrize("bad", [0, -1, "2", True, None])
def test_weights_must_be_positive_numbers(bad):
    with pytest.raises(ValueError, match="fair_share_weights"):
        VirtualTokenCounter({"x": bad})


def _admitted(s: Scheduler, steps: int) -> list[str]:
    order = []
    for _ in range(steps):
        step = schedule(s)
        order += [x.request.caller for x in step.scheduled if x.request.num_computed_tokens == 0]
        s.update_from_output(step.output, worker_output(step))
    return order


def test_a_light_caller_is_admitted_ahead_of_a_heavy_backlog():
    s = Scheduler(KVCacheManager(256, 16), max_num_seqs=2, max_num_batched_tokens=64)
    for _ in range(20):
        s.add_request(req("heavy"))
    for _ in range(2):
        s.add_request(req("light"))         # arrived last
    order = _admitted(s, 40)
    assert order[:4].count("light") >= 1 and order[:8].count("light") == 2, order


def test_without_caller_names_arrival_order_stands():
    s = Scheduler(KVCacheManager(256, 16), max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [req("") for _ in range(6)]
    for r in reqs:
        s.add_request(r)
    admitted = []
    for _ in range(30):
        step = schedule(s)
        admitted += [x.request for x in step.scheduled if x.request.num_computed_tokens == 0]
        s.update_from_output(step.output, worker_output(step))
    assert admitted == reqs


@pytest.mark.parametrize("weights", [{"a": 2.0, "b": 1.0}, {"a": 1.0, "b": 3.0}])
def test_weights_set_the_token_shares(weights):
    vtc = VirtualTokenCounter(weights)
    s = Scheduler(KVCacheManager(1024, 16), max_num_seqs=4, max_num_batched_tokens=64, fairness=vtc)
    for _ in range(200):                     # both callers stay backlogged throughout (at most 1 request a step
        s.add_request(req("a"))              # finishes here: 300 steps use < 200 of either)
        s.add_request(req("b"))
    for _ in range(300):
        step = schedule(s)
        s.update_from_output(step.output, worker_output(step))

    def cost(c):
        return PREFILL_COST * vtc.served_prefill[c] + DECODE_COST * vtc.served_decode[c]
    share_a = cost("a") / (cost("a") + cost("b"))
    want = weights["a"] / (weights["a"] + weights["b"])
    assert abs(share_a - want) <= 0.1 * want, (share_a, want)


def test_the_step_budget_goes_to_the_least_served_callers_prefill_first():
    """Admission alone is not enough: a heavy caller's running prefills, admitted first, would take every step's
    budget ahead of a light caller's prompt. With two callers running, decodes go first, then prefills by counter."""
    s = Scheduler(KVCacheManager(256, 16), max_num_seqs=8, max_num_batched_tokens=64,
                  long_prefill_token_threshold=32)
    heavy = [req("heavy", n_prompt=256) for _ in range(3)]
    for r in heavy:
        s.add_request(r)
    first = schedule(s)                                   # heavy's first two chunks take the budget
    assert [x.request for x in first.scheduled] == heavy[:2]
    s.update_from_output(first.output, worker_output(first))
    light = req("light", n_prompt=40)
    s.add_request(light)
    step = schedule(s)
    assert step.scheduled[0].request is light and step.scheduled[0].num_new_tokens == 32, \
        [(x.request.caller, x.num_new_tokens) for x in step.scheduled]
    s.update_from_output(step.output, worker_output(step))
    step = schedule(s)                                    # its last 8 tokens: still first, done in 2 steps
    assert step.scheduled[0].request is light and step.scheduled[0].num_new_tokens == 8
    s.update_from_output(step.output, worker_output(step))
    step = schedule(s)                                    # now decoding: decodes go first
    assert step.scheduled[0].request is light and step.scheduled[0].num_new_tokens == 1
    assert s.fairness.num_scheduled == {"heavy": 2, "light": 1}   # heavy[2] still waits: the budget is spent
    assert set(s.fairness.queue_time_s) == {"heavy", "light"}


def test_with_one_caller_the_step_order_is_admission_order():
    s = Scheduler(KVCacheManager(256, 16), max_num_seqs=8, max_num_batched_tokens=64,
                  long_prefill_token_threshold=32)
    reqs = [req("solo", n_prompt=96) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    for _ in range(3):
        step = schedule(s)
        order = [x.request for x in step.scheduled]
        assert order == sorted(order, key=reqs.index)
        s.update_from_output(step.output, worker_output(step))


def _step(s: Scheduler):
    step = schedule(s)
    s.update_from_output(step.output, worker_output(step))
    return step


@pytest.mark.parametrize("weights,seats", [({}, 2), ({"light": 3.0}, 3)])
def test_a_light_caller_takes_seats_from_a_heavy_caller_up_to_its_share(weights, seats):
    """With every seat taken by a heavy caller's long requests, a light caller's arrival preempts the heavy
    caller's last-admitted request (recompute) instead of waiting for one to finish, up to its seat share (4 seats
    in proportion to the weights: 2 of 4 with equal weights, 3 with weight 3 against 1); a caller at its share is
    never preempted, and every request still gets all its tokens."""
    s = Scheduler(KVCacheManager(512, 16), max_num_seqs=4, max_num_batched_tokens=64,
                  fairness=VirtualTokenCounter(weights))
    heavy = [req("heavy", max_tokens=40) for _ in range(6)]
    for r in heavy:
        s.add_request(r)
    for _ in range(3):
        _step(s)
    assert [r.caller for r in s.running] == ["heavy"] * 4
    light = [req("light", max_tokens=40) for _ in range(4)]
    for r in light:
        s.add_request(r)
    preempted = []
    for _ in range(seats + 2):
        step = _step(s)
        preempted += step.preempted
    assert [r.caller for r in s.running].count("light") == seats
    assert len(preempted) == seats and all(r.caller == "heavy" for r in preempted)
    assert preempted[0] is heavy[3]                       # the last admitted, the least progress
    for _ in range(400):
        if not s.has_unfinished():
            break
        _step(s)
    assert not s.has_unfinished()
    assert all(len(r.output_token_ids) == 40 for r in heavy + light)


def test_a_caller_within_its_share_keeps_its_seats():
    s = Scheduler(KVCacheManager(512, 16), max_num_seqs=2, max_num_batched_tokens=64)
    for caller in ("a", "b"):
        s.add_request(req(caller, max_tokens=30))
    _step(s)
    s.add_request(req("a", max_tokens=30))                # a holds 1 of 2 seats: its share; b is at its share too
    for _ in range(10):
        assert not _step(s).preempted
    s.add_request(req("c", max_tokens=30))                # three callers, two seats: shares of 1, nobody is over
    for _ in range(10):
        assert not _step(s).preempted


def test_a_light_callers_prefill_gets_a_step_of_its_own_beside_a_crowding_caller():
    """A heavy caller with more requests live than its seat share has long prompts in prefill; a light caller's
    prompt then runs in a step with no other prefill (its first token after its own prompt's step), and the heavy
    chunks go on in the next step. Without crowding (heavy within its share) steps are shared."""
    s = Scheduler(KVCacheManager(1024, 16), max_num_seqs=4, max_num_batched_tokens=256,
                  long_prefill_token_threshold=32)
    for _ in range(12):
        s.add_request(req("heavy", n_prompt=200, max_tokens=3))
    for _ in range(2):
        _step(s)
    light = req("light", n_prompt=24, max_tokens=3)
    s.add_request(light)
    step = _step(s)
    prefills = [x for x in step.scheduled if x.num_new_tokens > 1]
    assert [x.request for x in prefills] == [light], [(x.request.caller, x.num_new_tokens) for x in step.scheduled]
    later = _step(s)
    assert sum(x.request.caller == "heavy" and x.num_new_tokens > 1 for x in later.scheduled) == 3
    calm = Scheduler(KVCacheManager(1024, 16), max_num_seqs=8, max_num_batched_tokens=256,
                     long_prefill_token_threshold=32)
    for _ in range(3):
        calm.add_request(req("heavy", n_prompt=200, max_tokens=3))
    _step(calm)
    calm.add_request(req("light", n_prompt=24, max_tokens=3))
    shared = _step(calm)
    assert [x.request.caller for x in shared.scheduled] == ["light", "heavy", "heavy", "heavy"]
