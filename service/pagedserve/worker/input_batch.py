"""The worker's own state of every request it has seen, kept across steps (vLLM v1's ``CachedRequestState`` and
persistent ``InputBatch``), and each step's flat tensors built from it.

The scheduler sends a request whole once (:class:`~pagedserve.scheduler_output.NewRequestData`), then only what
changed (:class:`~pagedserve.scheduler_output.CachedRequestData`): tokens appended, the tail of its block table,
its computed count. A request's state lives until its id comes back in ``finished_req_ids``; a preemption keeps it
(the RNG stream and the prompt logprobs already reported go on where they were). Each live request holds a row of
the per-row sampling tensors (temperature, top-k, top-p, min-p), written once when it arrives, so a step gathers
its sampled rows' settings with one index instead of rebuilding them from the parameters.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..attention.base import AttentionMetadata
from ..sample.ops.bitmask import MaskRow
from ..sample.ops.topk_topp import SamplingTensors
from ..sample.sampler import SamplingRow, make_generator
from ..sampling_params import SamplingParams
from ..scheduler_output import NewRequestData, SchedulerOutput


@dataclass(eq=False, slots=True)
class CachedRequestState:
    """What the worker keeps of one request."""

    req_id: int                      # the engine's id
    prompt_token_ids: list[int]
    token_ids: list[int]             # prompt + output (the tokens the scheduler has sent)
    output_token_ids: list[int]      # output only (the sampling row reads it; extended in place)
    params: SamplingParams
    block_ids: list[int]             # the block table
    num_computed_tokens: int         # tokens whose KV is in the cache before the current step
    sampling: SamplingRow            # the sampler's view of it
    slot: int                        # its row in the sampling tensors
    prompt_logprobs: int | None      # top-k of prompt logprobs (None: none)
    num_prompt_logprobs: int = 0     # prompt positions whose logprobs were computed (kept across preemption)
    pooling: bool = False
    beam_search: bool = False        # its step output is the next-token log-softmax

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class StepEntry:
    """One scheduled request of the current step."""

    state: CachedRequestState
    num_new_tokens: int              # tokens computed this step (drafts included)
    draft_token_ids: list[int]       # drafts computed after its known tokens ([] for none)
    samples: bool                    # this step reaches the end of its known tokens (a token is sampled)


class InputBatch:
    """The requests' states and the step's flat tensors.

    Args:
        block_size: tokens per KV block. device: where the tensors go.
        layout: the KV layer groups (:class:`~pagedserve.kv_layout.KVLayout`; None: one group). With
            several, a state's ``block_ids`` are the groups' tables interleaved and each group gets its own block
            tables and slot mapping (:attr:`AttentionMetadata.groups`).
    """

    def __init__(self, block_size: int, device: torch.device, layout=None):
        self.block_size = block_size
        self.device = device
        self.layout = layout if layout is not None and layout.hybrid else None
        self.states: dict[int, CachedRequestState] = {}
        self._free_slots: list[int] = []
        self._capacity = 0
        self._tensors = SamplingTensors(*(torch.empty(0, dtype=d, device=device)
                                          for d in (torch.float32, torch.int64, torch.float32, torch.float32)))

    def __len__(self) -> int:
        return len(self.states)

    # ---- state -------------------------------------------------------------------------------------------------
    def update_states(self, sched: SchedulerOutput) -> None:
        """Forget finished requests, add new ones, apply the changes of cached ones."""
        for req_id in sched.finished_req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self._free_slots.append(state.slot)
        for new in sched.new_requests:
            self._add(new)
        for cached in sched.cached_requests:
            state = self.states[cached.req_id]
            if cached.new_token_ids:
                state.token_ids.extend(cached.new_token_ids)
                state.output_token_ids.extend(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            del state.block_ids[cached.num_kept_blocks:]
            state.block_ids.extend(cached.new_block_ids)

    def _add(self, new: NewRequestData) -> None:
        output = list(new.output_token_ids)
        generator = make_generator(new.seed) if new.seed is not None else None
        slot = self._take_slot(new.sampling_params)
        self.states[new.req_id] = CachedRequestState(
            new.req_id, list(new.prompt_token_ids), list(new.prompt_token_ids) + output, output,
            new.sampling_params, list(new.block_ids), new.num_computed_tokens,
            SamplingRow(params=new.sampling_params, prompt_token_ids=new.prompt_token_ids, output_token_ids=output,
                        generator=generator, eos_token_ids=new.eos_token_ids),
            slot, new.prompt_logprobs, pooling=new.pooling, beam_search=new.beam_search)

    def _take_slot(self, params: SamplingParams) -> int:
        if not self._free_slots:
            grown = max(8, 2 * self._capacity)
            self._tensors = SamplingTensors(*(torch.cat([t, t.new_zeros(grown - self._capacity)])
                                              for t in self._tensors))
            self._free_slots.extend(range(grown - 1, self._capacity - 1, -1))
            self._capacity = grown
        slot = self._free_slots.pop()
        t = self._tensors
        t.temperature[slot], t.top_k[slot] = params.temperature, params.top_k
        t.top_p[slot], t.min_p[slot] = params.top_p, params.min_p
        return slot

    def entries(self, sched: SchedulerOutput) -> list[StepEntry]:
        """The step's scheduled requests, decodes (one new token) first, longest context first (attention backends
        group decodes of similar length), then prefill chunks in scheduling order (the sort is stable)."""
        out = []
        for req_id, n in sched.num_scheduled_tokens.items():
            state = self.states[req_id]
            drafts = sched.scheduled_spec_decode_tokens.get(req_id, [])
            out.append(StepEntry(state, n, drafts, state.num_computed_tokens + n - len(drafts) == len(state.token_ids)))
        out.sort(key=lambda e: (e.num_new_tokens != 1, -e.state.num_computed_tokens if e.num_new_tokens == 1 else 0))
        return out

    # ---- the step's tensors ------------------------------------------------------------------------------------
    def prepare(self, entries: list[StepEntry]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat ``input_ids [T]``, ``positions [T]`` (int64) and the attention metadata for ``entries``, which
        must list decodes (``num_new_tokens == 1``) first."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        query_lens, context_lens, starts = [], [], [0]
        for e in entries:
            state, start = e.state, e.state.num_computed_tokens
            end = start + e.num_new_tokens
            input_ids.extend((state.token_ids[start:] + e.draft_token_ids)[:e.num_new_tokens] if e.draft_token_ids
                             else state.token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = state.block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(block_ids)
            query_lens.append(e.num_new_tokens)
            context_lens.append(end)
            starts.append(starts[-1] + e.num_new_tokens)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        dev = self.device
        layout = self.layout
        if layout is not None:   # the groups' tables, de-interleaved, and their slots
            G = layout.num_groups
            group_tables = [[t[g::G] for t in tables] for g in range(G)]
            group_slots = [[t[p // bs] * bs + p % bs for t, e in zip(tables_g, entries)
                            for p in range(e.state.num_computed_tokens, e.state.num_computed_tokens + e.num_new_tokens)]
                           for tables_g in group_tables]
            tables, slots = group_tables[0], group_slots[0]
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_context_len=max(context_lens), num_decode_seqs=num_decodes,
            query_lens_cpu=query_lens, context_lens_cpu=context_lens)
        if layout is not None:
            metas = [meta] + [dataclasses.replace(
                meta, slot_mapping=torch.tensor(group_slots[g], dtype=torch.int64, device=dev),
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in group_tables[g]], dtype=torch.int32,
                                          device=dev)) for g in range(1, G)]
            for m in metas:
                m.groups, m.layer_groups = metas, layout.layer_group
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    def sampling_rows(self, entries: list[StepEntry], sched: SchedulerOutput) -> list[SamplingRow]:
        """The sampling rows of ``entries`` (no drafts): one per entry, its grammar the step's bitmask row."""
        rows = []
        for e in entries:
            row = e.state.sampling
            row.grammar = _mask(sched, e.state.req_id, 0)
            rows.append(row)
        return rows

    def verify_rows(self, entries: list[StepEntry], sched: SchedulerOutput) -> list[SamplingRow]:
        """Sampling rows of a verification step: for each entry ``1 + drafts`` rows, row ``j`` seeing the output
        with the first ``j`` drafts appended (penalties, min_tokens) and the grammar mask at that position."""
        rows = []
        for e in entries:
            state, drafts = e.state, e.draft_token_ids
            output = state.output_token_ids
            for j in range(len(drafts) + 1):
                rows.append(SamplingRow(params=state.params, prompt_token_ids=state.prompt_token_ids,
                                        output_token_ids=output + drafts[:j] if j else output,
                                        generator=state.sampling.generator,
                                        eos_token_ids=state.sampling.eos_token_ids,
                                        grammar=_mask(sched, state.req_id, j)))
        return rows

    def sampling_tensors(self, entries: list[StepEntry], rows_per_entry: list[int] | None = None) -> SamplingTensors:
        """The per-row settings of ``entries`` (each repeated ``rows_per_entry[i]`` times; default once)."""
        slots = [e.state.slot for e in entries] if rows_per_entry is None else \
            [e.state.slot for e, k in zip(entries, rows_per_entry) for _ in range(k)]
        return self._tensors.select(torch.tensor(slots, dtype=torch.long, device=self.device))


def _mask(sched: SchedulerOutput, req_id: int, j: int) -> MaskRow | None:
    first = sched.structured_output_request_ids.get(req_id)
    return None if first is None else MaskRow(sched.grammar_bitmask[first + j])
