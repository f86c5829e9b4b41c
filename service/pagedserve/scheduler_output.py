"""The step as data: what the scheduler tells the worker each step (vLLM v1's ``SchedulerOutput``).

A leaf module (plain values, one optional CPU tensor): the scheduler builds it, the executor ships it (one
broadcast under tensor parallelism) and every rank's worker reads it. A request is sent whole once
(:class:`NewRequestData`, when the worker has not seen it); after that only what changed (:class:`CachedRequestData`:
new tokens, the tail of its block table, its computed count). The worker keeps its own state per request until the
request's id comes back in ``finished_req_ids``; a preempted request keeps that state (its RNG, its prompt logprobs
so far) and returns as a cached request whose block table starts over.

Request ids here are the engine's unique integer ids (:attr:`pagedserve.request.Request.seq_id`), never the
client's strings (a completion id ``"x#1"`` may equal another client's id).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen: everything it keeps for it."""

    req_id: int                     # the engine's id of the request (Request.seq_id)
    prompt_token_ids: list[int]     # the prompt
    output_token_ids: list[int]     # tokens generated before the worker saw it (a beam fork's; else [])
    sampling_params: SamplingParams  # the request's parameters (the sampler's per-row settings)
    eos_token_ids: frozenset[int]   # the model's EOS ids (min_tokens masks them)
    block_ids: list[int]            # its block table, logical -> physical block id
    num_computed_tokens: int        # tokens whose KV is in the cache already (prefix cache, shared blocks)
    seed: int | None = None         # the request's own RNG seed (None: the sampler's shared generator)
    prompt_logprobs: int | None = None  # top-k of prompt logprobs to compute (None: none; the n-th completions
                                    # of one request leave them to the first)
    pooling: bool = False           # an embedding request: the prompt's last final hidden state is its output
    beam_search: bool = False       # beam search: the step returns its next-token log-softmax, samples nothing


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker knows, scheduled again: what changed since the worker last saw it."""

    req_id: int                     # the engine's id of the request
    new_token_ids: list[int]        # tokens appended since the worker last saw it (sampled, or chosen by beams)
    num_computed_tokens: int        # tokens whose KV is in the cache before this step
    num_kept_blocks: int            # the first this many block ids are unchanged (0 after a preemption)
    new_block_ids: list[int]        # the block table from ``num_kept_blocks`` on


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work. ``num_scheduled_tokens`` lists every scheduled request in scheduling order."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)  # req id -> tokens computed this step
                                    # (drafts included), in scheduling order
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)  # req id -> drafts computed
                                    # after its known tokens (the step verifies them)
    grammar_bitmask: torch.Tensor | None = None  # [rows, W] int32 CPU: structured output's next-token masks
    structured_output_request_ids: dict[int, int] = field(default_factory=dict)  # req id -> its first row in
                                    # grammar_bitmask (1 + drafts rows, one per sampled position)
    preempted_req_ids: list[int] = field(default_factory=list)  # preempted during this step (KV freed)
    finished_req_ids: list[int] = field(default_factory=list)   # ended since the previous step: forget them
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) block ids,
                                    # copied in every layer before this step's forward
    num_batched_tokens: int = 0     # sum of num_scheduled_tokens

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
