"""From the scheduler's per-request updates to the deltas the front ends stream (vLLM v1's ``OutputProcessor``):
detokenization, stop strings, prompt logprobs gathered across prefill chunks, finish reasons and usage.

Stop strings are matched on the text here, after :meth:`~pagedserve.core.sched.scheduler.Scheduler
.update_from_output` appended the step's tokens: a match ends the request at that token, so tokens a verified run
appended after it are taken back (they were never shown), as if the run had stopped there.
"""
from __future__ import annotations

from dataclasses import dataclass

import structlog

from ..core.sched.output import RequestUpdate
from ..outputs import CompletionDelta, StepResult, TokenLogprobs, Usage
from ..request import Request, RequestStatus
from .detokenizer import IncrementalDetokenizer

log = structlog.get_logger(__name__)

FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass(slots=True)
class RequestGroup:
    """The n completions of one client request."""

    request_id: str
    children: list[Request]
    num_finished: int = 0
    beam: object | None = None   # beam search: its BeamGroup (the searcher streams the group's deltas)


class OutputProcessor:
    """Owns the live request groups and each completion's detokenizer (one engine thread uses it).

    Args:
        tokenizer: the model's transformers tokenizer.
        finish: ends a request in the scheduler (``Scheduler.finish``): a stop string found here ends it.
    """

    def __init__(self, tokenizer, finish):
        self.tokenizer = tokenizer
        self._finish = finish
        self.groups: dict[str, RequestGroup] = {}
        # Keyed by the Request object: completion ids ("id#i") may coincide with another client's request id.
        self._detok: dict[Request, IncrementalDetokenizer] = {}
        self._prompt_lps: dict[Request, list[TokenLogprobs]] = {}  # prompt logprobs gathered across prefill chunks

    def add(self, group: RequestGroup, detokenize: bool = True) -> None:
        """Track a group; with ``detokenize`` each completion gets a detokenizer (pooling and beam groups don't)."""
        self.groups[group.request_id] = group
        if detokenize:
            for req in group.children:
                self._detok[req] = IncrementalDetokenizer(self.tokenizer, req.params, req.prompt_token_ids)

    def process(self, result: StepResult, updates: list[RequestUpdate]) -> list[CompletionDelta]:
        """The deltas of one step: pooled embeddings, then one delta per updated request."""
        for req, lps in (result.prompt_logprobs or {}).items():
            self._prompt_lps.setdefault(req, []).extend(lps)
        deltas = []
        for i, entry in enumerate(result.pooled):
            req = entry.request
            if req.is_finished:
                continue
            self._finish(req, RequestStatus.FINISHED_STOPPED)
            deltas.append(self.finish_delta(req, CompletionDelta(req.parent_id, 0, embedding=result.pooled_hidden[i])))
        for update in updates:
            deltas.append(self._delta(update))
        return deltas

    def _delta(self, update: RequestUpdate) -> CompletionDelta:
        req = update.request
        delta = CompletionDelta(req.parent_id, req.index, token_ids=list(update.new_token_ids))
        if any(lp is not None for lp in update.new_logprobs):
            delta.logprobs = [lp for lp in update.new_logprobs if lp is not None]
        if req.params.prompt_logprobs is not None and req.index == 0 and \
                req.num_output_tokens == len(update.new_token_ids):
            delta.prompt_logprobs = self._prompt_lps.pop(req, [])
        try:
            if update.error is None:
                self._detokenize(update, delta)
        except Exception as exc:  # one request's failure must not take the others down
            update.error = exc
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        if update.error is not None:
            log.error("request_failed", request_id=req.parent_id, exc_info=update.error)
            delta.error = update.error
            if not req.is_finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
        if req.is_finished:
            self.finish_delta(req, delta)
        return delta

    def _detokenize(self, update: RequestUpdate, delta: CompletionDelta) -> None:
        """Feed the new tokens to the detokenizer (a stop token's text only with include_stop_str_in_output); a
        stop string ends the request at the token that completed it."""
        req = update.request
        detok = self._detok[req]
        tokens = update.new_token_ids
        for j, token in enumerate(tokens):
            last = j == len(tokens) - 1
            if last and update.stopped_by_token and not req.params.include_stop_str_in_output:
                break
            text = detok.add_tokens([token])
            delta.text += text.text
            if text.stop_str is None or (last and update.stopped_by_token):
                continue
            extra = len(tokens) - 1 - j      # tokens appended after the stop string: never shown
            if extra:
                del req.token_ids[-extra:], delta.token_ids[-extra:]
                if delta.logprobs is not None:
                    delta.logprobs = delta.logprobs[:len(delta.token_ids)]
            if not req.is_finished:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, text.stop_str
            return

    def finish_delta(self, req: Request, delta: CompletionDelta) -> CompletionDelta:
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
            delta.usage = _usage(group.children)
        return delta


def _usage(children: list[Request]) -> Usage:
    first = children[0]
    scheduled = [c.first_scheduled_time for c in children if c.first_scheduled_time is not None]
    return Usage(first.num_prompt_tokens, sum(c.num_output_tokens for c in children), max(first.num_cached_tokens, 0),
                 max(0.0, min(scheduled) - first.arrival_time) if scheduled else None)
