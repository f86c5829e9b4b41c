"""What the engine's layers hand each other: the sampler's outputs, a step's result, and the per-completion deltas
the engine streams to the front ends. A leaf module: it imports only torch and the standard library, so every layer
(worker, sample, beam_search, engine, serving, server, http) may use it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .core.sched.output import ScheduledRequest
    from .request import Request


class TokenLogprobs(NamedTuple):
    """One sampled (or prompt) token's log-probability under the raw model distribution."""

    token_id: int                    # the token
    logprob: float                   # its natural-log probability
    rank: int                        # 1 + number of tokens strictly more likely (1 = most likely)
    top: list[tuple[int, float]]     # the k most likely (token id, logprob), most likely first


@dataclass
class SamplerOutput:
    """One step's result, one entry per row of the logits."""

    token_ids: list[int]                      # the chosen token of each row
    logprobs: list[TokenLogprobs | None]      # set for rows whose params.logprobs is not None


@dataclass
class VerifyOutput:
    """A verification step's result (:meth:`pagedserve.sample.rejection_sampler.RejectionSampler.verify`), one
    entry per request."""

    token_ids: list[list[int]]                  # emitted tokens: the accepted drafts, then the target's own token
    logprobs: list[list[TokenLogprobs | None]]  # one per emitted token (None entries when not asked for)
    num_accepted: list[int]                     # drafts accepted (len(token_ids[i]) - 1)


@dataclass(slots=True)
class StepResult:
    """What one model step produced (:meth:`pagedserve.worker.model_runner.ModelRunner.execute`)."""

    sampled: list["ScheduledRequest"]    # the scheduled entries that sampled, in the order of `output`'s rows
    output: SamplerOutput | VerifyOutput | None  # None when no row sampled (all prefill chunks); VerifyOutput
                                         # (one entry per sampled request) when some request had drafts
    prompt_logprobs: dict["Request", list[TokenLogprobs]] | None = None  # request -> this step's prompt positions
    pooled: list["ScheduledRequest"] = field(default_factory=list)  # pooling requests whose prompt ended this step
    pooled_hidden: torch.Tensor | None = None  # [len(pooled), hidden] float32 CPU: their last tokens' final states
    beam_logprobs: dict["Request", torch.Tensor] | None = None  # beam search beams that sampled -> next-token
                                         # log-softmax [vocab] float32 CPU (not in `sampled`)

    def emitted(self, i: int) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens (and their logprobs) the ``i``-th sampled entry emits: one, or a verified run of drafts."""
        out = self.output
        if isinstance(out, VerifyOutput):
            return out.token_ids[i], out.logprobs[i]
        return [out.token_ids[i]], [out.logprobs[i]]

    def num_accepted(self, i: int) -> int:
        """Drafts accepted for the ``i``-th sampled entry (0 without drafts)."""
        return self.output.num_accepted[i] if isinstance(self.output, VerifyOutput) else 0


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
