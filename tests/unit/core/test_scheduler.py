"""Scheduler unit tests: built from plain values, no model."""
from __future__ import annotations

from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.core.sched.scheduler import Scheduler
from sched_cases import schedule, worker_output


def req(rid: str, n_prompt: int, priority: int = 0) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 40)  # distinct prompts: no accidental prefix-cache sharing
    return Request(rid, list(range(base + 1, base + n_prompt + 1)), SamplingParams(), max_tokens=64,
                   eos_token_ids=frozenset(), priority=priority)


def run_step(s: Scheduler):
    """One step through the scheduler's contract: schedule, a stand-in worker samples token 5, update."""
    step = schedule(s)
    s.update_from_output(step.output, worker_output(step))
    return step


def test_chunked_prefill_under_token_budget_with_running_decodes():
    s = Scheduler(KVCacheManager(64, 16), max_num_seqs=8, max_num_batched_tokens=64)
    a = req("a", 10)
    s.add_request(a)
    run_step(s)                           # a prefills in one step and samples
    assert a.num_output_tokens == 1
    b = req("b", 200)
    s.add_request(b)
    steps = []
    while b.num_output_tokens == 0:
        out = run_step(s)
        steps.append({e.request.request_id: e.num_new_tokens for e in out.scheduled})
        assert out.num_batched_tokens <= 64
    # a decodes one token in every step while b's prompt is chunked across steps.
    assert all(st["a"] == 1 for st in steps)
    assert sum(st["b"] for st in steps) == 200 and len(steps) >= 4


def test_long_prefill_threshold_caps_a_chunk():
    s = Scheduler(KVCacheManager(64, 16), 8, 512, long_prefill_token_threshold=100)
    b = req("b", 300)
    s.add_request(b)
    assert run_step(s).scheduled[0].num_new_tokens == 100


def test_priority_then_arrival_order():
    s = Scheduler(KVCacheManager(64, 16), max_num_seqs=1, max_num_batched_tokens=64)
    low, high = req("low", 4, priority=5), req("high", 4, priority=-1)
    s.add_request(low)
    s.add_request(high)
    assert run_step(s).scheduled[0].request is high


def test_preemption_by_recompute_when_blocks_run_out():
    s = Scheduler(KVCacheManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = req("a", 7), req("b", 7)
    s.add_request(a)
    s.add_request(b)
    run_step(s)                            # both admitted: 2 blocks each, all 4 used
    assert s.kv_cache.num_free_blocks == 0
    run_step(s)                            # position 7 still fits in the second blocks
    out = run_step(s)                      # position 8: a needs a 3rd block, b (last admitted) is preempted
    assert b in out.preempted and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.blocks == []
    assert s.num_preemptions == 1 and s.waiting()[0] is b
    assert [e.request for e in out.scheduled] == [a]


def test_finish_frees_blocks_from_anywhere():
    s = Scheduler(KVCacheManager(16, 4), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = req("a", 9), req("b", 9)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)   # b was still waiting
    s.finish(b, RequestStatus.FINISHED_ABORTED)   # idempotent
    assert not s.has_unfinished() and s.kv_cache.num_free_blocks == 16


def test_waiting_queue_limit():
    s = Scheduler(KVCacheManager(16, 4), 1, 64, max_waiting_requests=2)
    s.add_request(req("a", 3))
    assert s.can_admit()
    s.add_request(req("b", 3))
    assert not s.can_admit()
