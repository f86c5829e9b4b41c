"""From the scheduler's decisions to the deltas the front ends stream (vLLM v1's ``OutputProcessor``): each
request's new tokens, text and logprobs, prompt logprobs gathered across prefill chunks, finish reasons and usage.
Every fact (tokens kept, text, how a request ended) was decided in
:meth:`~pagedserve.core.sched.scheduler.Scheduler.update_from_output`; this only shapes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import structlog

from ..core.sched.output import EngineCoreOutputs, RequestUpdate
from ..outputs import CompletionDelta, TokenLogprobs, Usage
from ..request import Request, RequestStatus

log = structlog.get_logger(__name__)

FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass(slots=True)
class RequestGroup:
    """The n completions of one client request."""

    request_id: str
    children: list[Request]
    num_finished: int = 0
    beam_group: object | None = None   # beam search: its BeamGroup (the beam groups stream the group's deltas)


class OutputProcessor:
    """Owns the live request groups (one engine thread uses it)."""

    def __init__(self):
        self.groups: dict[str, RequestGroup] = {}
        self._prompt_lps: dict[Request, list[TokenLogprobs]] = {}  # prompt logprobs gathered across prefill chunks

    def add(self, group: RequestGroup) -> None:
        """Track a group."""
        self.groups[group.request_id] = group

    def process(self, outputs: EngineCoreOutputs) -> list[CompletionDelta]:
        """The deltas of one step: one per updated request (pooled first), then the final deltas of beam searches
        that ended."""
        for req, lps in outputs.prompt_logprobs.items():
            self._prompt_lps.setdefault(req, []).extend(lps)
        deltas = [self._delta(update) for update in outputs.updates]
        for d in outputs.beam_deltas:
            if d.usage is not None:
                self.groups.pop(d.request_id, None)
        return deltas + outputs.beam_deltas

    def _delta(self, update: RequestUpdate) -> CompletionDelta:
        req = update.request
        if update.embedding is not None:
            return self.finish_delta(req, CompletionDelta(req.parent_id, 0, embedding=update.embedding))
        delta = CompletionDelta(req.parent_id, req.index, update.text, list(update.new_token_ids))
        if any(lp is not None for lp in update.new_logprobs):
            delta.logprobs = [lp for lp in update.new_logprobs if lp is not None]
        if req.params.prompt_logprobs is not None and req.index == 0 and \
                req.num_output_tokens == len(update.new_token_ids):
            delta.prompt_logprobs = self._prompt_lps.pop(req, [])
        if update.error is not None:
            log.error("request_failed", request_id=req.parent_id, exc_info=update.error)
            delta.error = update.error
        if req.is_finished:
            self.finish_delta(req, delta)
        return delta

    def finish_delta(self, req: Request, delta: CompletionDelta) -> CompletionDelta:
        """Fill the finish fields of ``delta`` (req already finished); usage when the whole group is done."""
        self._prompt_lps.pop(req, None)
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
