"""The synchronous engine core: requests in, one ``step()`` at a time, per-completion deltas out.

``step()`` = schedule -> model forward + sampling -> append tokens, check stops, detokenize -> free finished
requests. The asyncio front (:mod:`pagedserve.engine.async_engine`) runs it on its own thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
import torch

from ..config import EngineConfig
from ..errors import DuplicateRequestError, InvalidInputError, QueueFullError
from .beam_engine import BeamGroup, BeamSearcher
from .detokenizer import IncrementalDetokenizer
from .kv_cache.manager import KVCacheManager
from .model_runner import ModelRunner, StepResult
from .request import Request, RequestStatus
from .sampler import TokenLogprobs, VerifyOutput, make_generator
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .spec_decode import build_proposer
from .spec_decode.grammar import draft_bitmasks
from .structured_output.grammar import GrammarCompiler
from .structured_output.waiting import GrammarWaitList

log = structlog.get_logger(__name__)

_POOLING_PARAMS = SamplingParams(max_tokens=1)  # placeholder: pooling requests sample nothing

FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass(slots=True)
class Usage:
    prompt_tokens: int           # after truncation
    completion_tokens: int       # over all n completions
    cached_prompt_tokens: int    # prompt tokens served from the prefix cache (first completion's)
    queue_time_s: float | None = None  # arrival to first scheduling of any completion (None: never scheduled)


@dataclass(slots=True)
class CompletionDelta:
    """What one completion produced in one step (one GenerateResponse)."""

    request_id: str                                  # the client's request id
    index: int                                       # which of the n completions
    text: str = ""                                   # new text since the previous delta
    token_ids: list[int] = field(default_factory=list)  # new token ids
    logprobs: list[TokenLogprobs] | None = None      # one per new token when requested
    finish_reason: str | None = None                 # None while running; "stop", "length" or "abort"
    matched_stop: int | str | None = None            # the stop token id or stop string that ended it
    usage: Usage | None = None                       # on the request's last delta
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the request's first delta, when asked for
    error: Exception | None = None                   # set when processing this request failed (it is aborted)
    embedding: torch.Tensor | None = None            # pooling requests: last token's final hidden state [hidden] fp32
    cumulative_logprob: float | None = None          # beam search: the completion's summed token logprobs


@dataclass(slots=True)
class RequestGroup:
    """The n completions of one client request."""

    request_id: str
    children: list[Request]
    num_finished: int = 0
    beam: BeamGroup | None = None   # beam search: the group (its live beams replace ``children``)


class LLMEngine:
    """Holds the tokenizer, model runner, KV cache and scheduler. Not thread-safe: one thread drives it.

    Args:
        config: the engine configuration.
        runner: a ready :class:`ModelRunner`.
        tokenizer: the model's transformers tokenizer.
        num_kv_blocks: blocks in the KV cache (the runner's caches hold this many).
        max_model_len: context length at most.
        eos_token_ids: ids that end a completion unless ignore_eos.
        vocab_size: logits width; token ids must be below it.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer, num_kv_blocks: int,
                 max_model_len: int, eos_token_ids: frozenset[int], vocab_size: int):
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.kv_cache = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, config.max_waiting_requests)
        self.groups: dict[str, RequestGroup] = {}
        # Keyed by the Request object: completion ids ("id#i") may coincide with another client's request id.
        self._detok: dict[Request, IncrementalDetokenizer] = {}
        self._prompt_lps: dict[Request, list[TokenLogprobs]] = {}  # prompt logprobs gathered across prefill chunks
        self._forking: list[RequestGroup] = []   # n > 1 groups whose other completions wait for the prompt
        self.grammars = GrammarCompiler(tokenizer, eos_token_ids)  # structured output: compiles off this thread
        self._awaiting_grammar = GrammarWaitList()  # groups not yet scheduled: their grammar is compiling
        self.speculative = config.speculative()   # speculative decoding settings (None: off)
        self.proposer = build_proposer(self.speculative) if self.speculative else None
        self.num_draft_tokens = 0                 # drafts verified since start-up
        self.num_accepted_tokens = 0              # of those, accepted
        self.beams = BeamSearcher(self.scheduler, tokenizer, max_model_len)  # beam search groups
        self.num_steps = 0
        self.last_step_composition: dict[str, int] = {}  # request id -> tokens computed in the latest step

    # ---- admission ---------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> list[Request]:
        """Validate and queue a request (``params.n`` completions).

        With ``params.structured_output``, the constraint is compiled on the grammar threads; until it is ready the
        request waits outside the scheduler (a cached constraint is scheduled at once).

        Raises:
            InvalidInputError: empty prompt, unknown token id, prompt or max_tokens past max_model_len; a
                constraint already known to be bad (a compile failure found later ends the request with an
                InvalidInputError as its delta's ``error``).
            DuplicateRequestError: ``request_id`` is live.
            QueueFullError: the waiting queue is full.
        """
        if request_id in self.groups:
            raise DuplicateRequestError(f"request {request_id!r} is already running", "request_id")
        params.validate_for_model(self.vocab_size, self.config.max_logprobs)
        ids = list(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:] if params.truncate_prompt_tokens else []
        self._check_prompt(ids, self.max_model_len - 1, "prompt")
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidInputError(f"max_tokens {params.max_tokens} exceeds the {room} tokens left after the "
                                    f"{len(ids)}-token prompt (max_model_len {self.max_model_len})",
                                    "sampling.max_tokens")
        if not self.scheduler.can_admit(params.n):
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.num_waiting} requests)")
        if params.beam_search is not None:
            leader = self.beams.add(request_id, ids, params, self.eos_token_ids, priority, cache_salt or None)
            self.groups[request_id] = RequestGroup(request_id, [leader], beam=leader.beam)
            return [leader]
        compiling, compiled = None, None
        if params.structured_output is not None:
            compiling = self.grammars.submit(params.structured_output)
            if compiling.done():  # a cached constraint (or a fast compile): settled now, no waiting
                if compiling.exception() is not None:
                    raise compiling.exception()
                compiling, compiled = None, compiling.result()
        children = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            gen = make_generator((params.seed + i) % 2 ** 64) if params.seed is not None else None
            req = Request(rid, ids, params, params.max_tokens or room, self.eos_token_ids, priority=priority,
                          cache_salt=cache_salt or None, generator=gen, parent_id=request_id, index=i)
            self._detok[req] = IncrementalDetokenizer(self.tokenizer, params, ids)
            children.append(req)
        group = RequestGroup(request_id, children)
        self.groups[request_id] = group
        if compiling is not None:
            self._awaiting_grammar.add(group, compiling, params.structured_output.field)
        else:
            self._schedule_group(group, compiled)
        return children

    def _schedule_group(self, group: RequestGroup, compiled=None) -> None:
        """Queue a group's first completion (the others follow once it has the prompt); ``compiled``: its
        CompiledGrammar, from which each completion gets its own matcher."""
        children = group.children
        if compiled is not None:
            for child in children:
                child.grammar = compiled.new_matcher()
        self.scheduler.add_request(children[0])
        if len(children) > 1:
            # n > 1: the other completions join once the first has computed the prompt, then share its full blocks.
            for child in children[1:]:
                child.fork_parent = children[0]
            self._forking.append(group)

    def _admit_compiled(self) -> list[CompletionDelta]:
        """Schedule the groups whose grammar has compiled; fail those whose compile failed or timed out (each
        completion ends with the error as its delta's ``error``). Aborted groups are dropped."""
        deltas = []
        for group, compiled, error in self._awaiting_grammar.pop_settled():
            live = [c for c in group.children if not c.is_finished]
            if not live:
                continue
            if error is None:
                self._schedule_group(group, compiled)
                continue
            for child in live:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                deltas.append(self._finish_delta(child, CompletionDelta(group.request_id, child.index,
                                                                        error=error)))
        return deltas

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
        if request_id in self.groups:
            raise DuplicateRequestError(f"request {request_id!r} is already running", "request_id")
        ids = list(token_ids)
        self._check_prompt(ids, self.max_model_len, field)
        if not self.scheduler.can_admit(1):
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.num_waiting} requests)")
        req = Request(request_id, ids, _POOLING_PARAMS, 1, frozenset(), priority=priority,
                      cache_salt=cache_salt or None, parent_id=request_id, pooling=True)
        self.groups[request_id] = RequestGroup(request_id, [req])
        self.scheduler.add_request(req)
        return req

    def _check_prompt(self, ids: list[int], max_len: int, field: str) -> None:
        if not ids:
            raise InvalidInputError("the prompt is empty" if field == "prompt" else "has no tokens", field)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                    "prompt_token_ids" if field == "prompt" else field)
        if len(ids) > max_len:
            hint = "so at most max_model_len - 1 prompt tokens fit" if field == "prompt" else "set truncate"
            subject = "the prompt has" if field == "prompt" else "has"
            raise InvalidInputError(f"{subject} {len(ids)} tokens; max_model_len is {self.max_model_len}, {hint}",
                                    field)

    def _release_forks(self) -> None:
        """Queue the waiting completions of n > 1 groups whose first completion has computed its prompt."""
        still = []
        for group in self._forking:
            first = group.children[0]
            if first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished:
                for child in group.children[1:]:
                    if not child.is_finished:
                        self.scheduler.add_request(child)
            else:
                still.append(group)
        self._forking = still

    def abort(self, request_ids) -> tuple[list[str], list[CompletionDelta]]:
        """Abort live requests by client id; unknown ids are ignored. Returns (aborted ids, their final deltas)."""
        aborted, deltas = [], []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            aborted.append(rid)
            if group.beam is not None:
                del self.groups[rid]
                deltas.extend(self.beams.abort(group.beam))
                continue
            for req in group.children:
                if not req.is_finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                    deltas.append(self._finish_delta(req, CompletionDelta(rid, req.index)))
        return aborted, deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._forking) or bool(self._awaiting_grammar)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[CompletionDelta]:
        """Run one scheduling step and return what each completion produced. With nothing to run but grammars
        compiling, it waits (briefly: at most 50 ms) for one to finish instead of spinning."""
        early: list[CompletionDelta] = []
        if self._awaiting_grammar:
            if not (self.scheduler.has_unfinished() or self._forking):
                self._awaiting_grammar.wait(0.05)
            early = self._admit_compiled()
        if self._forking:  # (also drops aborted n > 1 groups, so has_unfinished() cannot stay true while idle)
            self._release_forks()
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return early
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        self.last_step_composition = {s.request.request_id: s.num_new_tokens for s in sched.scheduled}
        result = self.runner.execute(sched)
        self.scheduler.update(sched)
        self.num_steps += 1
        if sched.preempted:
            self.beams.on_preempted(sched.preempted)
        deltas = self._process(result)
        if result.beam_logprobs:
            deltas += self._process_beams(result.beam_logprobs)
        if self._forking:
            self._release_forks()
        return early + deltas if early else deltas

    def _propose(self) -> None:
        """Speculative decoding: set each running request's drafts for this step (``spec_token_ids``; [] for
        none). Only decoding requests get drafts, never more than could still be emitted (max_tokens, max_model_len
        leave room for the target model's own token after them), none at all when the batch has
        ``disable_by_batch_size`` requests or more. Constrained requests' drafts are cut where the grammar forbids
        one, and the mask at each draft position is kept for the sampler."""
        running = self.scheduler.running
        limit = self.speculative.disable_by_batch_size
        off = limit is not None and len(running) >= limit
        todo, room = [], []
        for req in running:
            req.spec_token_ids, req.spec_bitmask = [], None
            if off or req.pooling or req.beam is not None or req.num_tokens - req.num_computed_tokens != 1:
                continue
            if req.spec_skip > 0:   # backing off after drafts that were all rejected
                req.spec_skip -= 1
                continue
            n = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            if n > 0:
                todo.append(req)
                room.append(n)
        if not todo:
            return
        for req, drafts in zip(todo, self.proposer.propose([r.token_ids for r in todo], room)):
            if drafts and req.grammar is not None:
                drafts, req.spec_bitmask = draft_bitmasks(req.grammar, drafts)
            req.spec_token_ids = drafts

    def _backoff(self, req: Request, accepted: int) -> None:
        """After a verification: an accepted draft resets the request's backoff; all rejected doubles it (1, 2, 4...
        steps without drafts, at most ``rejection_backoff_max``)."""
        limit = self.speculative.rejection_backoff_max
        req.spec_backoff = 0 if accepted or not limit else min(limit, max(1, 2 * req.spec_backoff))
        req.spec_skip = req.spec_backoff

    def _process(self, result: StepResult) -> list[CompletionDelta]:
        deltas = []
        for req, lps in (result.prompt_logprobs or {}).items():
            self._prompt_lps.setdefault(req, []).extend(lps)
        for i, entry in enumerate(result.pooled):
            req = entry.request
            if req.is_finished:
                continue
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            deltas.append(self._finish_delta(req, CompletionDelta(req.parent_id, 0,
                                                                  embedding=result.pooled_hidden[i])))
        if result.output is None:
            return deltas
        verified = isinstance(result.output, VerifyOutput)
        for i, entry in enumerate(result.sampled):
            req = entry.request
            if req.is_finished:
                continue
            delta = CompletionDelta(req.parent_id, req.index)
            if req.params.prompt_logprobs is not None and req.index == 0 and req.num_output_tokens == 0:
                delta.prompt_logprobs = self._prompt_lps.pop(req, [])
            out = result.output
            tokens, lps = (out.token_ids[i], out.logprobs[i]) if verified else ([out.token_ids[i]], [out.logprobs[i]])
            try:
                for token, lp in zip(tokens, lps):  # a stop inside an accepted run ends it right there
                    self._append_token(req, token, lp, delta)
                    if req.is_finished:
                        break
                if entry.draft_token_ids:
                    self.num_draft_tokens += len(entry.draft_token_ids)
                    self.num_accepted_tokens += out.num_accepted[i]
                    self._backoff(req, out.num_accepted[i])
                    self.scheduler.rollback_drafts(req)
            except Exception as exc:  # one request's failure must not take the others down
                log.exception("request_failed", request_id=req.parent_id)
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                delta.error = exc
                self._finish_delta(req, delta)
            deltas.append(delta)
        return deltas

    def _process_beams(self, rows) -> list[CompletionDelta]:
        """Beam groups step on their logprob rows; the ones that ended leave ``groups``."""
        deltas = self.beams.process(rows)
        for d in deltas:
            if d.usage is not None:
                self.groups.pop(d.request_id, None)
        return deltas

    def _append_token(self, req: Request, token: int, logprobs, delta: CompletionDelta) -> None:
        req.append_output_token(token)
        delta.token_ids.append(token)
        if logprobs is not None:
            delta.logprobs = (delta.logprobs or []) + [logprobs]
        params, status = req.params, None
        can_stop = req.num_output_tokens > params.min_tokens  # the sampler masks stops until then
        if can_stop and token in params.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif can_stop and not params.ignore_eos and token in req.eos_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif req.grammar is not None:
            req.grammar.accept(token)            # the mask allowed it; a completed grammar ends with STOP below
        if status is None or params.include_stop_str_in_output:
            update = self._detok[req].add_tokens([token])
            delta.text += update.text
            if update.stop_str is not None and status is None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, update.stop_str
        if status is None and req.grammar is not None and req.grammar.is_terminated():
            status = RequestStatus.FINISHED_STOPPED
        if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)
            self._finish_delta(req, delta)

    def _finish_delta(self, req: Request, delta: CompletionDelta) -> CompletionDelta:
        """Fill the finish fields of ``delta`` (req already finished); usage when the whole group is done."""
        self._prompt_lps.pop(req, None)
        detok = self._detok.pop(req, None)
        if detok is not None and not isinstance(req.stop_reason, str) and delta.error is None:
            delta.text += detok.flush()
            if detok.matched_stop is not None and req.stop_reason is None:  # the held-back tail completed a stop
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.matched_stop
        delta.finish_reason = FINISH_REASONS[req.status]
        delta.matched_stop = req.stop_reason
        group = self.groups[req.parent_id]
        group.num_finished += 1
        if group.num_finished == len(group.children):
            del self.groups[req.parent_id]
            first = group.children[0]
            scheduled = [c.first_scheduled_time for c in group.children if c.first_scheduled_time is not None]
            delta.usage = Usage(first.num_prompt_tokens, sum(c.num_output_tokens for c in group.children),
                                max(first.num_cached_tokens, 0),
                                max(0.0, min(scheduled) - first.arrival_time) if scheduled else None)
        return delta

    # ---- introspection -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        kv = self.kv_cache
        return {"num_blocks_total": kv.num_blocks, "num_blocks_free": kv.num_free_blocks, "usage": kv.usage,
                "prefix_cache_queries_tokens": kv.stats.queries_tokens, "prefix_cache_hits_tokens": kv.stats.hits_tokens,
                "num_requests_running": len(self.scheduler.running),
                "num_requests_waiting": self.scheduler.num_waiting, "num_preemptions": self.scheduler.num_preemptions,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens}
