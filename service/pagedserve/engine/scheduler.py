"""Continuous-batching scheduler with a token budget, chunked prefill and preemption by recompute
(Orca, Yu et al. OSDI 2022; vLLM v1's unified scheduler).

Each step: running requests first, in admission order (decodes and unfinished prefill chunks alike), then waiting
requests by (priority, arrival). A request gets ``min(tokens left to compute, budget left, long_prefill_threshold)``
new tokens. When blocks run out, the last admitted running request is preempted: its blocks are freed and it goes
back to the front of the waiting queue, to be recomputed later (the prefix cache usually brings most of it back).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from .kv_cache.manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request            # the request
    num_new_tokens: int         # tokens computed for it this step
    samples: bool               # True when this step reaches the end of its known tokens (a new token is sampled)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative drafts computed after the known tokens
                                # (counted in num_new_tokens; the step verifies them)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # this step's work, in scheduling order
    preempted: list[Request] = field(default_factory=list)           # requests preempted during this step
    num_batched_tokens: int = 0                                      # sum of num_new_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step's batch. Builds from plain values: ``Scheduler(KVCacheManager(64, 16), 8, 256)``.

    Args:
        kv_cache: the KV cache manager.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: new tokens per step at most (the token budget).
        long_prefill_token_threshold: tokens one prefill may take in a step (0: no cap beyond the budget).
        max_waiting_requests: waiting queue length at most (0: unbounded); :meth:`can_admit` reports it.
    """

    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, max_waiting_requests: int = 0):
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.max_waiting_requests = max_waiting_requests
        self.running: list[Request] = []
        self._waiting: list[tuple[int, float, int, Request]] = []   # heap of (priority, arrival, seq, request)
        self._seq = itertools.count()
        self.num_preemptions = 0

    # ---- queue -------------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[Request]:
        return [entry[3] for entry in sorted(self._waiting)]

    def can_admit(self, num_new: int = 1) -> bool:
        return self.max_waiting_requests <= 0 or self.num_waiting + num_new <= self.max_waiting_requests

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (request.priority, request.arrival_time, next(self._seq), request))

    def _push_front(self, request: Request) -> None:
        # A preempted request goes ahead of everything of its priority (-inf arrival keeps that order stable).
        heapq.heappush(self._waiting, (request.priority, float("-inf"), -next(self._seq), request))

    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting)

    # ---- step --------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work and allocate its KV blocks. Never fails for lack of memory: it preempts instead."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.long_prefill_token_threshold)
            if n <= 0:
                i += 1
                req.spec_token_ids = []
                continue
            drafts = self._schedule_drafts(req, n, budget)
            if drafts:
                out.scheduled.append(ScheduledRequest(req, n + len(drafts), True, drafts))
                budget -= n + len(drafts)
                i += 1
                continue
            while not self.kv_cache.allocate_slots(req, n):
                victim = self.running.pop()            # the last admitted request
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing after it can be running
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _schedule_drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Speculative drafts for a decoding request: as many of ``req.spec_token_ids`` as fit in the budget after
        its ``n`` known tokens, with KV slots allocated for them (drafts never cause a preemption: without free
        blocks the request decodes plainly). Returns the scheduled drafts ([] for none); clears the proposal."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or n != req.num_tokens - req.num_computed_tokens:
            return []
        drafts = drafts[:max(0, budget - n)]
        if not drafts or not self.kv_cache.allocate_slots(req, n + len(drafts)):
            return []
        return drafts

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._waiting[0][3]
            cached = self.kv_cache.find_cached_prefix(req) if not req.blocks else []
            num_cached = len(cached) * self.kv_cache.block_size
            n = min(req.num_tokens - req.num_computed_tokens - num_cached, budget, self.long_prefill_token_threshold)
            if not self.kv_cache.allocate_slots(req, n, cached):
                break
            heapq.heappop(self._waiting)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        self._push_front(req)

    def update(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` after the step's forward ran (before new tokens are appended). With
        drafts this counts them too; :meth:`rollback_drafts` takes the rejected ones back."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens

    def rollback_drafts(self, request: Request) -> None:
        """After a verified step (its tokens appended): forget the KV of rejected drafts. ``num_computed_tokens``
        drops to ``num_tokens - 1`` (the last token, verified or resampled, is computed next step) and blocks past
        what ``num_tokens`` needs go back to the pool (they were never hashed: only known tokens are)."""
        if request.is_finished:
            return
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv_cache.trim(request, request.num_tokens)

    # ---- removal -----------------------------------------------------------------------------------------------
    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from wherever it is (running, waiting, or not queued yet) and free its blocks.
        Safe to call twice."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._waiting = [e for e in self._waiting if e[3] is not request]
            heapq.heapify(self._waiting)
        self.kv_cache.free(request)
        request.status = status
