"""What the engine's layers hand each other: the sampler's outputs, a step's result, and the per-completion deltas
the engine streams to the front ends. A leaf module: it imports only torch and the standard library, so every layer
(worker, sample, beam_search, engine, serving, server, http) may use it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


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
class ModelRunnerOutput:
    """What one step produced on the worker (:meth:`pagedserve.worker.model_runner.ModelRunner.execute`), keyed by
    the engine's request ids (:attr:`pagedserve.scheduler_output.NewRequestData.req_id`). Plain values."""

    req_ids: list[int] = field(default_factory=list)  # requests that sampled, in the order of the logits rows
    sampled_token_ids: list[list[int]] = field(default_factory=list)  # per such request: its token, or a verified
                                         # run (the accepted drafts, then the target model's own token)
    logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)  # one per sampled token (None
                                         # entries when not asked for)
    num_accepted: list[int] = field(default_factory=list)  # drafts accepted per such request (0 without drafts)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # req id -> this step's prompt
                                         # positions
    pooled_req_ids: list[int] = field(default_factory=list)  # pooling requests whose prompt ended this step
    pooled_hidden: torch.Tensor | None = None  # [len(pooled_req_ids), hidden] float32 CPU: their last tokens'
                                         # final hidden states
    beam_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)  # beam search requests that reached
                                         # their next token -> its log-softmax [vocab] float32 CPU


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
class EngineTimings:
    """When one traced generation request went through the engine, in monotonic seconds (``time.monotonic()``).
    Made by the request pipeline only while tracing is on (:mod:`pagedserve.serving.call_trace`), filled by the
    engine thread (:class:`pagedserve.engine.timings.TimingRecorder`), read once the request's stream has ended."""

    submitted: float                           # handed to the engine (after tokenizing)
    first_scheduled: float | None = None       # first scheduled in a step (None: never)
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens computed)
                                               # of each step before the first completion's first token
    first_token: float | None = None           # end of the step that sampled the first token (of any completion)
    last_token: float | None = None            # end of the step that sampled the last token
    num_decode_steps: int = 0                  # steps of the first completion after its first token
    detokenize_s: float = 0.0                  # time in the incremental detokenizer, over every completion
    num_cached_tokens: int = 0                 # prompt tokens the prefix cache served (first completion)
    num_preemptions: int = 0                   # over every completion
