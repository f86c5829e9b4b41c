"""What the scheduler decides for one step (:class:`SchedulerOutput`) and what it reports back after the step
(:class:`RequestUpdate`, from :meth:`~.scheduler.Scheduler.update_from_output`). Plain values, no tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...outputs import TokenLogprobs
from ...request import Request


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
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) block ids to copy
                                                                     # in every layer before this step's forward

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    """One sampled request after a step (vLLM's ``EngineCoreOutput``): the tokens appended to it and how it ended."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)   # appended this step (a verified run: up to 1 + drafts)
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # one per new token
    stopped_by_token: bool = False   # the last new token is a stop token / EOS (its text is not shown unless
                                     # include_stop_str_in_output)
    num_draft_tokens: int = 0        # drafts this step verified
    num_accepted: int = 0            # of those, accepted
    error: Exception | None = None   # appending failed (the request is aborted)
