"""The synchronous engine: requests in, one ``step()`` at a time, per-completion deltas out.

``step()`` in vLLM v1's shape, plain data between the stages: ``scheduler.schedule()`` -> ``SchedulerOutput`` ->
``executor.execute`` (forward + sampling on the worker) -> ``ModelRunnerOutput`` -> ``scheduler.update_from_output``
(tokens, stop tokens and strings, length, draft rollback: every finish decided there) -> the output processor
(deltas and usage). The asyncio front (:mod:`pagedserve.engine.async_engine`) runs it on its own thread.
"""
from __future__ import annotations

import time

from ..config import EngineConfig
from ..core.detokenizer import IncrementalDetokenizer
from ..core.kv_cache.manager import KVCacheManager
from ..core.sched.beam_groups import BeamGroups
from ..core.sched.deadlines import DeadlinePolicy
from ..core.sched.fairness import VirtualTokenCounter
from ..core.sched.drafts import Drafter
from ..core.sched.scheduler import Scheduler
from ..core.sched.stop import OutputText
from ..errors import DuplicateRequestError, QueueFullError
from ..executor.base import Executor
from ..outputs import CompletionDelta
from ..reasoning import get_parser
from ..reasoning.gate import ReasoningGate, TokenTexts
from ..request import Request
from ..sampling_params import SamplingParams
from ..structured_output.manager import StructuredOutputManager
from .input_processor import InputProcessor
from .output_processor import OutputProcessor, RequestGroup

_POOLING_PARAMS = SamplingParams(max_tokens=1)  # placeholder: pooling requests sample nothing


class LLMEngine:
    """Holds the tokenizer, the executor, the KV block accounting and the scheduler. Not thread-safe: one thread
    drives it.

    Args:
        config: the engine configuration.
        executor: a ready :class:`~pagedserve.executor.base.Executor` (its runner initialized).
        tokenizer: the model's transformers tokenizer.
        num_kv_blocks: blocks in the KV cache (the executor's caches hold this many).
        max_model_len: context length at most.
        eos_token_ids: ids that end a completion unless ignore_eos.
        vocab_size: logits width; token ids must be below it.
        kv_group_windows: per KV layer group (:class:`~pagedserve.kv_layout.KVLayout`) its sliding window, None for
            full attention; window groups give back the blocks behind their window while a request runs
            (:class:`~pagedserve.core.kv_cache.manager.KVCacheManager`). Default: one full-attention group.
    """

    def __init__(self, config: EngineConfig, executor: Executor, tokenizer, num_kv_blocks: int,
                 max_model_len: int, eos_token_ids: frozenset[int], vocab_size: int,
                 kv_group_windows: tuple[int | None, ...] = (None,)):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.kv_cache = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                       group_windows=kv_group_windows)
        speculative = config.speculative()
        self.deadlines = DeadlinePolicy(config.long_prefill_token_threshold or config.max_num_batched_tokens,
                                        config.max_queue_time_s, config.deadline_scheduling)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, config.max_waiting_requests, max_model_len,
                                   text=OutputText(tokenizer),
                                   drafter=Drafter(speculative, max_model_len) if speculative else None,
                                   deadlines=self.deadlines, fairness=VirtualTokenCounter(config.fair_share()))
        self.inputs = InputProcessor(vocab_size, max_model_len, config.max_logprobs)
        self.outputs = OutputProcessor()
        self.structured = StructuredOutputManager(tokenizer, eos_token_ids)  # compiles off this thread
        self.beams = BeamGroups(self.scheduler, self._detokenizer, max_model_len)
        # --reasoning-parser: a grammar starts once the reasoning has ended (reasoning/gate.py)
        self.reasoning = get_parser(config.reasoning_parser) if config.reasoning_parser else None
        self._token_texts = TokenTexts(tokenizer) if self.reasoning is not None else None
        self.num_steps = 0

    @property
    def drafter(self) -> Drafter | None:
        """Speculative decoding's drafter (acceptance counts); None when it is off."""
        return self.scheduler.drafter

    @property
    def last_step_composition(self) -> dict[str, int]:
        """Request id -> tokens computed in the latest step."""
        return self.scheduler.last_step_composition

    @last_step_composition.setter
    def last_step_composition(self, value: dict[str, int]) -> None:
        self.scheduler.last_step_composition = value

    @property
    def groups(self) -> dict[str, RequestGroup]:
        """Live requests by client id."""
        return self.outputs.groups

    @property
    def hidden_size(self) -> int:
        """Width of the model's final hidden states (a pooling request's embedding)."""
        return int(self.executor.model.config.hidden_size)

    def _detokenizer(self, params: SamplingParams, prompt_token_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids)

    # ---- admission ---------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None, deadline: float | None = None,
                    caller: str = "") -> list[Request]:
        """Validate and queue a request (``params.n`` completions). ``deadline``: the call's, in
        ``time.monotonic()`` seconds (None: none); kept as :mod:`pagedserve.core.sched.deadlines` describes.
        ``caller``: who sent it, for fair shares (:mod:`pagedserve.core.sched.fairness`; "": not named).

        With ``params.structured_output``, the constraint is compiled on the grammar threads; until it is ready the
        request waits outside the scheduler (a cached constraint is scheduled at once). With a reasoning parser
        (``config.reasoning_parser``) the grammar starts only once the completion's reasoning has ended
        (:class:`~pagedserve.reasoning.gate.ReasoningGate`).

        Raises:
            InvalidInputError: see :meth:`InputProcessor.generation`; a constraint already known to be bad (a
                compile failure found later ends the request with an InvalidInputError as its delta's ``error``).
            DuplicateRequestError: ``request_id`` is live.
            QueueFullError: the waiting queue is full.
            DeadlineError: it cannot finish before ``deadline`` even if it started now.
        """
        self._check_new(request_id)
        ids, max_tokens = self.inputs.generation(prompt_token_ids, params)
        if deadline is not None and self.deadlines.enabled:
            probe = Request(request_id, ids, params, max_tokens, self.eos_token_ids, deadline=deadline)
            error = self.deadlines.refusal(probe, time.monotonic(), self.scheduler.running)
            if error is not None:
                raise error
        self._check_room(params.n)
        if params.beam_search is not None:
            beams = self.beams.add(request_id, ids, params, self.eos_token_ids, priority, cache_salt or None)
            self.outputs.add(RequestGroup(request_id, [beams.beams[0]], beam_group=beams))
            return [beams.beams[0]]
        children = []
        for i in range(params.n):
            seed = (params.seed + i) % 2 ** 64 if params.seed is not None else None
            children.append(Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params, max_tokens,
                                    self.eos_token_ids, priority=priority, cache_salt=cache_salt or None,
                                    seed=seed, parent_id=request_id, index=i, deadline=deadline,
                                    caller=caller))
            self.scheduler.text.add(children[-1])
        group = RequestGroup(request_id, children)
        compiled = None
        if params.structured_output is not None:
            compiled = self.structured.admit(group, params.structured_output)
            if compiled is None:       # compiling: scheduled once it is ready (:meth:`_admit_compiled`)
                self.outputs.add(group)
                return children
        self.outputs.add(group)
        self._schedule_group(group, compiled)
        return children

    def add_pooling_request(self, request_id: str, token_ids: list[int], priority: int = 0,
                            cache_salt: str | None = None, field: str = "inputs") -> Request:
        """Queue an embedding request: its tokens are prefilled like a prompt (chunked, prefix cache, batched with
        generation), then the final hidden state of its last token (after the model's last norm; HF's
        ``last_hidden_state[:, -1]``) comes back as the ``embedding`` of its one delta. Nothing is sampled.

        Raises:
            InvalidInputError: (naming ``field``) no tokens, unknown token id, more than max_model_len tokens.
            DuplicateRequestError: ``request_id`` is live.
            QueueFullError: the waiting queue is full.
        """
        self._check_new(request_id)
        ids = list(token_ids)
        self.inputs.check_prompt(ids, self.max_model_len, field)
        self._check_room(1)
        req = Request(request_id, ids, _POOLING_PARAMS, 1, frozenset(), priority=priority,
                      cache_salt=cache_salt or None, parent_id=request_id, pooling=True)
        self.outputs.add(RequestGroup(request_id, [req]))
        self.scheduler.add_request(req)
        return req

    def _check_new(self, request_id: str) -> None:
        if request_id in self.groups:
            raise DuplicateRequestError(f"request {request_id!r} is already running", "request_id")

    def _check_room(self, num_new: int) -> None:
        if not self.scheduler.can_admit(num_new):
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.num_waiting} requests)")

    def _schedule_group(self, group: RequestGroup, compiled=None) -> None:
        """Queue a group (``compiled``: its CompiledGrammar, from which each completion gets its own matcher)."""
        if compiled is not None:
            tail = self.tokenizer.decode(group.children[0].prompt_token_ids[-16:]) if self.reasoning else ""
            for child in group.children:
                child.grammar = compiled.new_matcher()
                if self.reasoning is not None:
                    child.grammar = ReasoningGate(child.grammar, self.reasoning, tail, self._token_texts)
        self.scheduler.add_group(group.children)

    def _admit_compiled(self) -> list[CompletionDelta]:
        """Schedule the groups whose grammar has compiled; fail those whose compile failed or timed out (each
        completion ends with the error as its delta's ``error``). Aborted groups are dropped."""
        deltas = []
        for group, compiled, error in self.structured.pop_settled():
            live = [c for c in group.children if not c.is_finished]
            if live and error is None:
                self._schedule_group(group, compiled)
            for child in live if error is not None else ():
                self.scheduler.abort(child, flush=False)
                deltas.append(self.outputs.finish_delta(child, CompletionDelta(group.request_id, child.index,
                                                                               error=error)))
        return deltas

    def abort(self, request_ids) -> tuple[list[str], list[CompletionDelta]]:
        """Abort live requests by client id; unknown ids are ignored. Returns (aborted ids, their final deltas)."""
        aborted, deltas = [], []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            aborted.append(rid)
            if group.beam_group is not None:
                del self.groups[rid]
                deltas.extend(self.beams.abort(group.beam_group))
                continue
            for req in group.children:
                if not req.is_finished:
                    self.deadlines.on_finished(req, time.monotonic(), calibrate=False)  # a deadline's cancel: a miss
                    text = self.scheduler.abort(req)
                    deltas.append(self.outputs.finish_delta(req, CompletionDelta(rid, req.index, text)))
        return aborted, deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(len(self.structured))

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[CompletionDelta]:
        """Run one scheduling step and return what each completion produced. With nothing to run but grammars
        compiling, it waits (briefly: at most 50 ms) for one to finish instead of spinning."""
        early = self._admit_waiting_grammars()
        if self.scheduler.num_waiting:
            early += self._refuse_late()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return early
        self.structured.grammar_bitmask(sched, self.scheduler.requests)
        start = time.monotonic()
        result = self.executor.execute(sched)
        self.deadlines.timer.observe(time.monotonic() - start)
        outputs = self.scheduler.update_from_output(sched, result)
        self.num_steps += 1
        deltas = self.outputs.process(outputs)
        self._count_missed(outputs)
        return early + deltas if early else deltas

    def _refuse_late(self) -> list[CompletionDelta]:
        """Refuse (before any prefill) the waiting requests the deadline policy gives up on: each completion of
        their group ends with the DeadlineError as its delta's ``error``."""
        deltas = []
        for req, error in self.scheduler.late_waiting(time.monotonic()):
            group = self.groups.get(req.parent_id)
            for child in group.children if group is not None else ():
                if not child.is_finished:
                    self.deadlines.stats.refused_prefill_tokens += child.num_computed_tokens
                    self.scheduler.abort(child, flush=False)
                    deltas.append(self.outputs.finish_delta(child, CompletionDelta(group.request_id, child.index,
                                                                                   error=error)))
        return deltas

    def _count_missed(self, outputs) -> None:
        now = None
        for update in outputs.updates:
            if update.request.deadline is not None and update.request.is_finished:
                now = now or time.monotonic()
                self.deadlines.on_finished(update.request, now)

    def _admit_waiting_grammars(self) -> list[CompletionDelta]:
        if not len(self.structured):
            return []
        if not self.scheduler.has_unfinished():
            self.structured.wait(0.05)
        return self._admit_compiled()

    # ---- introspection and lifetime ----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        kv = self.kv_cache
        drafter = self.drafter
        return {"num_blocks_total": kv.num_blocks, "num_blocks_free": kv.num_free_blocks, "usage": kv.usage,
                "prefix_cache_queries_tokens": kv.stats.queries_tokens, "prefix_cache_hits_tokens": kv.stats.hits_tokens,
                "num_requests_running": len(self.scheduler.running),
                "num_requests_waiting": self.scheduler.num_waiting, "num_preemptions": self.scheduler.num_preemptions,
                "spec_decode_num_draft_tokens": drafter.num_draft_tokens if drafter else 0,
                "spec_decode_num_accepted_tokens": drafter.num_accepted_tokens if drafter else 0,
                "kv_blocks_freed_behind_window": kv.num_window_freed_blocks,
                "deadline_refusals_expired": self.deadlines.stats.refused_expired,
                "deadline_refusals_infeasible": self.deadlines.stats.refused_infeasible,
                "deadline_refusals_queue_time": self.deadlines.stats.refused_queue_time,
                "deadline_refused_prefill_tokens": self.deadlines.stats.refused_prefill_tokens,
                "deadline_misses": self.deadlines.stats.missed, "caller_tokens": self.caller_stats()}

    def caller_stats(self) -> dict[str, dict[str, float]]:
        """Per caller (fair shares), since start: ``prefill`` / ``decode`` tokens scheduled, ``queue_time_s``
        (seconds its requests waited for their first step, summed) over ``scheduled`` requests, and deadline
        ``refused`` requests (any reason)."""
        vtc, refused = self.scheduler.fairness, self.deadlines.stats.refused_by_caller
        callers = set(vtc.served_prefill) | set(vtc.served_decode) | set(vtc.num_scheduled) | set(refused)
        return {c: {"prefill": vtc.served_prefill.get(c, 0), "decode": vtc.served_decode.get(c, 0),
                    "queue_time_s": vtc.queue_time_s.get(c, 0.0), "scheduled": vtc.num_scheduled.get(c, 0),
                    "refused": refused.get(c, 0)} for c in callers}

    def close(self) -> None:
        """Release the executor (tensor-parallel workers stop) and the grammar threads. Idempotent."""
        self.executor.close()
        self.structured.shutdown()
