"""A request as the engine tracks it: tokens, progress, KV blocks and status.

There are no prefill or decode modes: ``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output).
A step that brings it level produces a new token; a step that does not is a prefill chunk.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams

_seq_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False, slots=True)
class Request:
    """One completion's state. ``n > 1`` requests become ``n`` of these sharing a ``parent_id``."""

    request_id: str                         # unique engine id (the client's id, plus "#i" for the i-th of n)
    prompt_token_ids: list[int]             # after truncate_prompt_tokens
    params: "SamplingParams"
    max_tokens: int                         # resolved: params.max_tokens or the room left in max_model_len
    eos_token_ids: frozenset[int]           # EOS ids of the model (ignored when params.ignore_eos)
    priority: int = 0                       # lower is served first
    cache_salt: str | None = None           # extra key of the prefix-cache hash chain
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, monotonic clock
    deadline: float | None = None           # the call's deadline, monotonic seconds (None: none); see
                                            # core.sched.deadlines
    caller: str = ""                        # who sent it (fair shares, core.sched.fairness); "": not named
    seed: int | None = None                 # the completion's own RNG seed (params.seed + index); None: shared
    parent_id: str | None = None            # the client's request id for n > 1 children
    index: int = 0                          # which of the n completions
    token_ids: list[int] = field(default_factory=list)  # prompt + output, filled in __post_init__
    num_computed_tokens: int = 0            # tokens whose KV is in the cache
    num_cached_tokens: int = -1             # prompt tokens that came from the prefix cache (-1: not yet scheduled)
    blocks: list[Any] = field(default_factory=list)  # the block table, logical -> physical (core.kv_cache KVBlocks)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks (kept across preemption)
    num_registered_blocks: int = 0          # leading blocks of `blocks` already hashed into the prefix cache
    fork_parent: "Request | None" = None    # n > 1: the completion whose prompt blocks this one shares
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # monotonic seconds; for queue time metrics
    planned_service_s: float | None = None  # the deadline policy's last plain estimate before admission (seconds)
    pooling: bool = False                   # an embedding request: the prompt's last hidden state is the output
    grammar: Any = None                     # structured output: its GrammarMatcher, in step with the output (kept
                                            # across preemption, which keeps the tokens); set once compiled
    spec_token_ids: list[int] = field(default_factory=list)  # speculative decoding: drafts proposed for the next
                                            # step (not part of token_ids until verified); cleared by the scheduler
    spec_backoff: int = 0                   # speculative decoding: steps without drafts after an all-rejected
    spec_skip: int = 0                      # verification (doubling, see SpeculativeConfig), and steps left
    spec_bitmask: Any = None                # structured output with drafts: [1 + drafts, W] int32 CPU, the
                                            # grammar's next-token bitmask at each draft position
    gang: Any = None                        # the requests it runs with as one unit (``members``, ``seats``; beam
                                            # search's BeamGroup, core.sched.beam_groups): scheduled, preempted and
                                            # readmitted together
    timings: Any = None                     # tracing: the pagedserve.outputs.EngineTimings the engine records
                                            # into (:mod:`pagedserve.engine.timings`); None: not traced
    seq_id: int = field(default_factory=lambda: next(_seq_ids))  # unique in the process: the id the worker and
                                            # the step's data know it by (client ids may repeat across completions)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
