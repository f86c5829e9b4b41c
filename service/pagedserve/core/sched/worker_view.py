"""What the worker knows of each request, and the step's decisions turned into the plain
:class:`~pagedserve.scheduler_output.SchedulerOutput` it reads: a request the worker has not seen is sent whole, one
it knows only as what changed (tokens appended since it last ran, the tail of its block table, its computed count).

Why a block table can be sent as a tail: the blocks before ``num_computed_tokens // block_size`` are never replaced
while a request runs (copy-on-write, draft trimming and new allocations only touch the tail); a preemption frees
them all, so the next table is sent from block 0. (Blocks given back behind a sliding window become null entries
in the scheduler's table but stay as they were in the worker's: no kernel reads a block before its window.) With
several layer groups the table is the groups' tables interleaved (:mod:`~pagedserve.kv_layout`), and the
tail starts at a whole logical block.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...request import Request
from ...scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from .output import ScheduledRequest


@dataclass(slots=True)
class _Known:
    num_tokens: int          # tokens of the request the worker has
    block_ids: list[int]     # the block table it has


class WorkerView:
    """Tracks the worker's view of the requests (the engine thread only). Args: ``block_size``: tokens per block;
    ``num_groups``: KV layer groups (table entries per logical block)."""

    def __init__(self, block_size: int, num_groups: int = 1):
        self.block_size, self.num_groups = block_size, num_groups
        self._known: dict[int, _Known] = {}
        self._finished: list[int] = []

    def build(self, scheduled: list[ScheduledRequest], preempted: list[Request],
              block_copies: list[tuple[int, int]], num_batched_tokens: int) -> SchedulerOutput:
        """The step's :class:`SchedulerOutput` (``scheduled`` in scheduling order); the view then holds what the
        worker will know after reading it."""
        out = SchedulerOutput(block_copies=block_copies, num_batched_tokens=num_batched_tokens,
                              finished_req_ids=self._finished)
        self._finished = []
        for req in preempted:
            known = self._known.get(req.seq_id)
            if known is not None:
                known.block_ids = []
            out.preempted_req_ids.append(req.seq_id)
        for s in scheduled:
            req = s.request
            out.num_scheduled_tokens[req.seq_id] = s.num_new_tokens
            if s.draft_token_ids:
                out.scheduled_spec_decode_tokens[req.seq_id] = s.draft_token_ids
            known = self._known.get(req.seq_id)
            if known is None:
                out.new_requests.append(self._new(req))
            else:
                out.cached_requests.append(self._changes(req, known))
        return out

    def _new(self, req: Request) -> NewRequestData:
        block_ids = [b.block_id for b in req.blocks]
        self._known[req.seq_id] = _Known(req.num_tokens, list(block_ids))
        params = req.params
        return NewRequestData(req.seq_id, req.prompt_token_ids, req.output_token_ids, params, req.eos_token_ids,
                              block_ids, req.num_computed_tokens, seed=req.seed,
                              prompt_logprobs=params.prompt_logprobs if req.index == 0 else None,
                              pooling=req.pooling, beam_search=req.params.beam_search is not None)

    def _changes(self, req: Request, known: _Known) -> CachedRequestData:
        new_tokens = req.token_ids[known.num_tokens:]
        known.num_tokens = req.num_tokens
        keep = min(len(known.block_ids), req.num_computed_tokens // self.block_size * self.num_groups)
        new_blocks = [b.block_id for b in req.blocks[keep:]]
        known.block_ids[keep:] = new_blocks
        return CachedRequestData(req.seq_id, new_tokens, req.num_computed_tokens, keep, new_blocks)

    def finished(self, req: Request) -> None:
        """``req`` ended: the worker forgets it at the next step."""
        if self._known.pop(req.seq_id, None) is not None:
            self._finished.append(req.seq_id)
