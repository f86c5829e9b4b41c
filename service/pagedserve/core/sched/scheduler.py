"""Continuous-batching scheduler with a token budget, chunked prefill and preemption by recompute
(Orca, Yu et al. OSDI 2022; vLLM v1's unified scheduler).

Each step: running requests first, in admission order (decodes and prefill chunks alike), then waiting requests
by (priority, fair share, deadline, arrival); with several callers, :mod:`.fairness` orders the step, may take a
seat for a caller below its share and may give one caller's prefills a step alone. A request gets ``min(tokens
left, budget left, long_prefill_threshold)`` new tokens. When blocks run out, the last running request is preempted:
its blocks are freed, it goes back to the front of the waiting queue, to be recomputed (the prefix cache usually
brings most of it back).

Features sit beside it behind narrow interfaces: a gang (``request.gang``: ``members``, ``seats``; beam search's
:mod:`.beam_groups`) is one unit: contiguous in ``running``, blocks (copy-on-write copies, which ride on
:attr:`SchedulerOutput.block_copies`, included) all or none, preempted and readmitted together; ``n > 1``
completions wait for their first one's prompt (:mod:`.forks`); drafts come from the drafter (:mod:`.drafts`).
"""
from __future__ import annotations

import time

from ..kv_cache.manager import KVCacheManager
from ...outputs import ModelRunnerOutput
from ...request import Request, RequestStatus
from ...scheduler_output import SchedulerOutput
from .deadlines import DeadlinePolicy
from .drafts import schedule_drafts
from .fairness import VirtualTokenCounter
from .forks import ForkWaitList
from .output import EngineCoreOutputs, RequestUpdate, ScheduledRequest, StepPlan
from .policies import DraftPolicy, GangOwner
from .stop import OutputText, check_stop, is_stop_token
from .waiting import WaitingQueue
from .worker_view import WorkerView


class Scheduler:
    """Decides each step's batch. Builds from plain values: ``Scheduler(KVCacheManager(64, 16), 8, 256)``.

    Args:
        kv_cache: the KV cache manager.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: new tokens per step at most (the token budget).
        long_prefill_token_threshold: tokens one prefill may take in a step (0: no cap beyond the budget).
        max_waiting_requests: waiting queue length at most (0: unbounded); :meth:`can_admit` reports it.
        max_model_len: context length at most (requests end with "length" there; None: only max_tokens ends them).
        text: the completions' detokenizers (stop strings, text); None: no text (tests of the scheduling alone).
        drafter: speculative decoding's drafts (:class:`.policies.DraftPolicy`); None: off.
        deadlines: the deadline checks and the EDF order within a priority (:class:`.deadlines.DeadlinePolicy`);
            None: a policy with no queue time limit.
        fairness: the callers' virtual token counters (:class:`.fairness.VirtualTokenCounter`); None: all weigh 1.
    """

    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, max_waiting_requests: int = 0,
                 max_model_len: int | None = None, text: OutputText | None = None,
                 drafter: DraftPolicy | None = None, deadlines: DeadlinePolicy | None = None,
                 fairness: VirtualTokenCounter | None = None):
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.max_waiting_requests = max_waiting_requests
        self.running: list[Request] = []
        self.num_preemptions, self._solo = 0, None   # _solo: the step's caller whose prefills run alone
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.forks = ForkWaitList()               # n > 1 completions waiting for their first one's prompt
        self.requests: dict[int, Request] = {}      # live requests by seq_id (queued or running)
        self.view, self.text = WorkerView(kv_cache.block_size, kv_cache.num_groups), text  # the worker's view
        self.gangs: GangOwner | None = None  # the gangs' owner (beam search's BeamGroups attaches itself)
        self.drafter = drafter
        self.last_step_composition: dict[str, int] = {}  # request id -> tokens computed in the latest step
        self.deadlines = deadlines or DeadlinePolicy(self.long_prefill_token_threshold)
        self.fairness = fairness or VirtualTokenCounter()
        self._waiting = WaitingQueue(self.deadlines, self.fairness)

    # ---- queue -------------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[Request]:
        return self._waiting.ordered()

    def can_admit(self, num_new: int = 1) -> bool:
        return self.max_waiting_requests <= 0 or self.num_waiting + num_new <= self.max_waiting_requests

    def add_request(self, request: Request) -> None:
        self._arrived(request)
        request.status = RequestStatus.WAITING
        self._waiting.push(request)

    def _arrived(self, request: Request) -> None:
        self.requests[request.seq_id] = request
        self.fairness.on_arrival(request.caller)

    def add_group(self, children: list[Request]) -> None:
        """Queue the n completions of one request: the first now, the others once it has computed the prompt
        (:class:`.forks.ForkWaitList`)."""
        self.add_request(children[0])
        if len(children) > 1:
            self.forks.add(children)

    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting or self.forks)

    # ---- step --------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work and allocate its KV blocks. Never fails for lack of memory: it preempts instead.
        Returns the step as plain data for the worker (:class:`~pagedserve.scheduler_output.SchedulerOutput`)."""
        if self.drafter is not None:
            self.drafter.propose(self.running)
        if self.forks:
            self.forks.release(self.add_request)
        out = StepPlan()
        budget = self.max_num_batched_tokens
        head = self._waiting.head()
        fair = all(r.gang is None for r in self.running) and \
            self.fairness.prefill_order(self.running, head)  # several callers: None when the plain order stands
        self.running = fair or self.running
        if fair and (seat := self.fairness.seat_victim(head, self.running, self.max_num_seqs)):
            self.running.remove(seat)      # a seat for a caller below its share (not for memory), and the
            self._preempt_one(seat, out)   # request back in its arrival place, not ahead of the others
            self._waiting.push(seat)
            head = self._waiting.head()
        self._solo = fair and self.fairness.solo_prefill(head, self.running, self.max_num_seqs)
        seated = len(out.preempted)                      # preempted for a seat, not for memory
        admitted: set[int] = set()                       # ids of requests admitted mid-loop (already scheduled)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if id(req) in admitted:
                i += 1
                continue
            if fair and req.num_tokens - req.num_computed_tokens > 1:   # a prefill: less-served waiting callers first
                budget = self._admit_waiting(out, budget, before=req, admitted=admitted)
                if self._solo and req.caller != self._solo:   # another caller's prefill waits for the next step
                    i += 1
                    continue
            if req.gang is not None:
                taken = self._schedule_gang(i, out, budget)
                if taken is None:
                    break  # the gang itself was preempted: nothing after it can be running
                i, budget = i + taken[0], taken[1]
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.long_prefill_token_threshold)
            if n <= 0:
                i += 1
                req.spec_token_ids = []
                continue
            drafts = schedule_drafts(self.kv_cache, req, n, budget)
            if drafts:
                out.scheduled.append(ScheduledRequest(req, n + len(drafts), True, drafts))
                budget -= n + len(drafts)
                i += 1
                continue
            while not self.kv_cache.allocate_slots(req, n):
                victim = self.running[-1]              # the last admitted request (or gang)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing after it can be running
        self.fairness.charge_scheduled([x for x in out.scheduled if id(x.request) not in admitted])
        if len(out.preempted) == seated:                 # nothing preempted for memory
            budget = self._admit_waiting(out, budget)
        return self._emit(out, self.max_num_batched_tokens - budget)

    def _emit(self, plan: StepPlan, num_batched_tokens: int) -> SchedulerOutput:
        now = time.monotonic()
        for s in plan.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
                self.fairness.on_first_scheduled(s.request.caller, now - s.request.arrival_time)
        self.last_step_composition = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
        if self.gangs is not None and plan.preempted:
            self.gangs.on_preempted(plan.preempted)
        return self.view.build(plan.scheduled, plan.preempted, self.kv_cache.take_block_copies(), num_batched_tokens)

    def _schedule_gang(self, i: int, out: StepPlan, budget: int) -> tuple[int, int] | None:
        """Schedule the gang whose members start at ``running[i]``, all its blocks at once (preempting later
        requests, or the gang itself, when they do not fit). Returns (members passed, budget left), or None when
        the gang was preempted."""
        gang = self.running[i].gang
        count = len(gang.members)
        members = self.running[i:i + count]
        assert all(b.gang is gang for b in members), "a gang's members must be contiguous in running"
        plan, left = [], budget
        for b in members:
            n = max(0, min(b.num_tokens - b.num_computed_tokens, left, self.long_prefill_token_threshold))
            plan.append((b, n))
            left -= n
        need = self.kv_cache.blocks_to_allocate(plan)
        while need > self.kv_cache.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim.gang is gang:
                return None
        for b, n in plan:
            b.spec_token_ids = []
            if n > 0:
                if not self.kv_cache.allocate_slots(b, n):
                    raise AssertionError("gang allocation failed after its blocks were counted")
                out.scheduled.append(ScheduledRequest(b, n, b.num_computed_tokens + n == b.num_tokens))
        return count, left

    def _admit_waiting(self, out: StepPlan, budget: int, before: Request | None = None,
                       admitted: set[int] | None = None) -> int:
        """Admit waiting requests while budget, seats and blocks last; with ``before`` (a running prefill), only
        those ahead of it in fair-share order (better priority, or same priority and a smaller caller counter),
        their ids added to ``admitted``. Returns the budget left."""
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._waiting.head()
            if before is not None and (req.gang is not None or not self.fairness.ahead(req, before)) or \
                    self._solo and req.caller != self._solo:
                break
            if admitted is not None:
                admitted.add(id(req))
            if req.gang is not None:
                left = self._admit_gang(req.gang, out, budget)
                if left is None:
                    break
                budget = left
                continue
            cached = self.kv_cache.find_cached_prefix(req) if not req.blocks else []
            num_cached = self.kv_cache.num_cached_tokens(cached)
            n = min(req.num_tokens - req.num_computed_tokens - num_cached, budget, self.long_prefill_token_threshold)
            if not self.kv_cache.allocate_slots(req, n, cached):
                break
            self._waiting.remove(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
            self.fairness.charge_scheduled(out.scheduled[-1:])
            budget -= n
        return budget

    def _admit_gang(self, gang, out: StepPlan, budget: int) -> int | None:
        """Admit all members of a waiting gang, or none: it needs its seats and, as an upper bound, blocks for every
        member's whole sequence (the prefix cache may share some: each member looks it up after the previous one
        registered its blocks). Returns the budget left, or None when it does not fit."""
        members = gang.members
        if self.running and len(self.running) + gang.seats > self.max_num_seqs:
            return None
        if sum(self.kv_cache.blocks_needed(b.num_tokens) for b in members) > self.kv_cache.num_free_blocks:
            return None
        self._waiting.remove(members[0])
        for b in members:
            cached = self.kv_cache.find_cached_prefix(b) if not b.blocks else []
            num_cached = self.kv_cache.num_cached_tokens(cached)
            n = max(0, min(b.num_tokens - b.num_computed_tokens - num_cached, budget,
                           self.long_prefill_token_threshold))
            if not self.kv_cache.allocate_slots(b, n, cached):
                raise AssertionError("gang admission failed after its blocks were counted")
            if b.num_cached_tokens < 0:
                b.num_cached_tokens = num_cached
            b.status = RequestStatus.RUNNING
            self.running.append(b)
            if n > 0:
                out.scheduled.append(ScheduledRequest(b, n, b.num_computed_tokens + n == b.num_tokens))
                self.fairness.charge_scheduled(out.scheduled[-1:])
            budget -= n
        return budget

    def insert_member(self, parent: Request, child: Request) -> None:
        """Put a new gang member forked from ``parent`` (its blocks already shared) right after it in running."""
        child.status = RequestStatus.RUNNING
        self._arrived(child)
        self.running.insert(self.running.index(parent) + 1, child)

    def _preempt(self, req: Request, out: StepPlan) -> None:
        """Preempt ``req`` (the last running request), or its whole gang: blocks freed, back to waiting."""
        if req.gang is None:
            self.running.pop()
            self._preempt_one(req, out)
            self._waiting.push_front(req)
            return
        gang = req.gang
        self.running = [r for r in self.running if r.gang is not gang]
        for b in gang.members:
            self._preempt_one(b, out, count=False)
        self.num_preemptions += 1          # one preemption per gang
        self._waiting.push_front(gang.members[0])

    def _preempt_one(self, req: Request, out: StepPlan, count: bool = True) -> None:
        self.kv_cache.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += count
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """The one place a step's results are decided: advance every scheduled request's ``num_computed_tokens``;
        end pooling requests whose prompt is complete; append each sampled request's new tokens (a verified run
        stops at its first stop), advance its grammar, end it on a stop token, a completed grammar or the length
        limit (:func:`.stop.check_stop`), take the KV of rejected drafts back, and detokenize them, ending it on a
        stop string (:class:`.stop.OutputText`); step the beam searches. One request's failure (say, its grammar
        refusing a token) aborts it alone: its update carries the error.

        Returns the step's :class:`EngineCoreOutputs`: one update per pooled, then per sampled request (in the
        worker's row order), the prompt logprobs of this step, the final deltas of beam searches that ended.
        """
        requests = self.requests
        for req_id, n in sched.num_scheduled_tokens.items():
            requests[req_id].num_computed_tokens += n
        outs = EngineCoreOutputs(prompt_logprobs={requests[r]: lps for r, lps in result.prompt_logprobs.items()})
        for i, req_id in enumerate(result.pooled_req_ids):
            req = requests[req_id]
            self.finish(req, RequestStatus.FINISHED_STOPPED)
            outs.updates.append(RequestUpdate(req, embedding=result.pooled_hidden[i]))
        for i, req_id in enumerate(result.req_ids):
            update = RequestUpdate(requests[req_id])
            self._apply(update, result.sampled_token_ids[i], result.logprobs[i],
                        sched.scheduled_spec_decode_tokens.get(req_id), result.num_accepted[i])
            outs.updates.append(update)
        if result.beam_logprobs:
            outs.beam_deltas = self.gangs.process({requests[r]: row for r, row in result.beam_logprobs.items()})
        if self.forks:
            self.forks.release(self.add_request)
        if self.drafter is not None:
            self.drafter.record(outs.updates)
        return outs

    def _apply(self, update: RequestUpdate, tokens: list[int], logprobs: list, drafts: list[int] | None,
               num_accepted: int) -> None:
        req = update.request
        try:
            for token, lp in zip(tokens, logprobs):
                self._append(req, token, lp, update)
                if req.is_finished:
                    break
            if drafts:
                update.num_draft_tokens, update.num_accepted = len(drafts), num_accepted
                self.rollback_drafts(req)
        except Exception as exc:  # one request's failure must not take the others down
            self.finish(req, RequestStatus.FINISHED_ABORTED)
            update.error = exc
        if self.text is None:
            return
        if update.error is None:
            try:
                self.text.push(update, self.finish)
            except Exception as exc:
                update.error = exc
                self.finish(req, RequestStatus.FINISHED_ABORTED)
        if req.is_finished:
            update.text += self.text.finish(req, flush=update.error is None)

    def _append(self, req: Request, token: int, logprobs, update: RequestUpdate) -> None:
        req.append_output_token(token)
        update.new_token_ids.append(token)
        update.new_logprobs.append(logprobs)
        update.stopped_by_token = is_stop_token(req, token)
        if req.grammar is not None and not update.stopped_by_token:
            req.grammar.accept(token)            # the mask allowed it; a completed grammar ends with STOP below
        ended = check_stop(req, token, self.max_model_len)
        if ended is not None:
            req.stop_reason = ended[1]
            self.finish(req, ended[0])

    def rollback_drafts(self, request: Request) -> None:
        """After a verified step (its tokens appended): forget the KV of rejected drafts. ``num_computed_tokens``
        drops to ``num_tokens - 1`` (the last token, verified or resampled, is computed next step) and blocks past
        what ``num_tokens`` needs go back to the pool (they were never hashed: only known tokens are)."""
        if request.is_finished:
            return
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv_cache.trim(request, request.num_tokens)

    def late_waiting(self, now: float) -> list[tuple[Request, Exception]]:
        """Waiting requests refused at ``now``, with their DeadlineError (:meth:`.waiting.WaitingQueue.late`)."""
        return self._waiting.late(now, self.running)

    # ---- removal -----------------------------------------------------------------------------------------------
    def abort(self, request: Request, flush: bool = True) -> str:
        """End ``request`` as aborted (a client's abort, a failed grammar compile); returns the held-back tail of
        its text (``flush``; "" otherwise or without text)."""
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return self.text.finish(request, flush) if self.text is not None else ""

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from wherever it is (running, waiting, not queued) and free its blocks; idempotent."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        if self.requests.pop(request.seq_id, None) is not None:
            self.fairness.on_leave(request.caller)
        self.view.finished(request)
