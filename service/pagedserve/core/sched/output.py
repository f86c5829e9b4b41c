"""The scheduler's own records of a step: what it decided (:class:`ScheduledRequest`, :class:`StepPlan`; the worker
gets these as the plain :class:`~pagedserve.scheduler_output.SchedulerOutput`) and what it decided after the step
(:class:`RequestUpdate` per request, gathered in :class:`EngineCoreOutputs` by
:meth:`~.scheduler.Scheduler.update_from_output`, vLLM's ``EngineCoreOutputs``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...outputs import CompletionDelta, TokenLogprobs
from ...request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request            # the request
    num_new_tokens: int         # tokens computed for it this step
    samples: bool               # True when this step reaches the end of its known tokens (a new token is sampled)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative drafts computed after the known tokens
                                # (counted in num_new_tokens; the step verifies them)


@dataclass(slots=True)
class StepPlan:
    """One step's decisions while the scheduler makes them."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # this step's work, in scheduling order
    preempted: list[Request] = field(default_factory=list)           # requests preempted during this step


@dataclass(slots=True)
class RequestUpdate:
    """One request after a step (vLLM's ``EngineCoreOutput``): the tokens appended to it, their text, how it ended."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)   # appended this step (a verified run: up to 1 + drafts)
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # one per new token
    text: str = ""                   # their text (stop strings cut; on the last update, the held-back tail too)
    stopped_by_token: bool = False   # the last new token is a stop token / EOS (its text is not shown unless
                                     # include_stop_str_in_output)
    num_draft_tokens: int = 0        # drafts this step verified
    num_accepted: int = 0            # of those, accepted
    embedding: torch.Tensor | None = None  # a pooling request: its last token's final hidden state [hidden] fp32
    error: Exception | None = None   # appending failed (the request is aborted)


@dataclass(slots=True)
class EngineCoreOutputs:
    """Everything one step decided, for the output processor to turn into deltas."""

    updates: list[RequestUpdate] = field(default_factory=list)  # pooled requests first, then the sampled ones
    prompt_logprobs: dict[Request, list[TokenLogprobs]] = field(default_factory=dict)  # this step's positions
    beam_deltas: list[CompletionDelta] = field(default_factory=list)  # beam searches that ended this step
