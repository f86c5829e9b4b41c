"""The model runner's per-request rows, kept across steps (vLLM v1's ``InputBatch``): each running request's block
id list and sampling row are built when it is first scheduled and then updated with what changed (new blocks, a
copy-on-write tail, new output tokens) instead of being rebuilt from the request every step.

Why a row's block ids can be extended in place: the blocks before ``num_computed_tokens // block_size`` are never
replaced while a request runs (copy-on-write, draft trimming and new allocations only touch the tail); a preemption
frees them all (``num_preemptions`` changes) and a finished request's row is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.base import AttentionMetadata
from ..core.sched.output import ScheduledRequest
from ..request import Request
from ..sample.sampler import SamplingRow
from ..spec_decode.grammar import MaskRow


@dataclass(slots=True)
class _Row:
    block_ids: list[int]        # the request's block table as ids
    num_preemptions: int        # the request's count when block_ids were taken
    output: list[int]           # its output tokens so far (the sampling row's output_token_ids)
    sampling: SamplingRow


class InputBatch:
    """Rows of the requests the runner has seen, and the step's flat tensors built from them.

    Args:
        block_size: tokens per KV block. device: where the tensors go.
    """

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self._rows: dict[Request, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, req: Request) -> _Row:
        row = self._rows.get(req)
        if row is None or row.num_preemptions != req.num_preemptions or \
                len(row.block_ids) < req.num_computed_tokens // self.block_size:
            output = req.output_token_ids
            row = self._rows[req] = _Row([b.block_id for b in req.blocks], req.num_preemptions, output,
                                         SamplingRow(params=req.params, prompt_token_ids=req.prompt_token_ids,
                                                     output_token_ids=output, generator=req.generator,
                                                     eos_token_ids=req.eos_token_ids, grammar=req.grammar))
            return row
        stable = req.num_computed_tokens // self.block_size    # blocks before this one are as they were
        del row.block_ids[stable:]
        row.block_ids.extend(b.block_id for b in req.blocks[stable:])
        return row

    def drop_finished(self) -> None:
        """Forget the rows of requests that ended (called once per step)."""
        for req in [r for r in self._rows if r.is_finished]:
            del self._rows[req]

    def prepare(self, entries: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat ``input_ids [T]``, ``positions [T]`` (int64) and the attention metadata for ``entries``, which
        must list decodes (``num_new_tokens == 1``) first."""
        self.drop_finished()
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        query_lens, context_lens, starts = [], [], [0]
        for e in entries:
            req, start = e.request, e.request.num_computed_tokens
            end = start + e.num_new_tokens
            input_ids.extend((req.token_ids[start:] + e.draft_token_ids)[:e.num_new_tokens] if e.draft_token_ids
                             else req.token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = self._row(req).block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(block_ids)
            query_lens.append(e.num_new_tokens)
            context_lens.append(end)
            starts.append(starts[-1] + e.num_new_tokens)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_context_len=max(context_lens), num_decode_seqs=num_decodes,
            query_lens_cpu=query_lens, context_lens_cpu=context_lens)
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    def sampling_rows(self, entries: list[ScheduledRequest]) -> list[SamplingRow]:
        """The sampling rows of ``entries`` (no drafts), each brought up to date with its request's new output
        tokens (appended, not re-sliced) and grammar."""
        rows = []
        for e in entries:
            req = e.request
            row = self._row(req)
            n = req.num_output_tokens
            if len(row.output) > n:      # tokens taken back (never for a running request; kept safe)
                row.output[:] = req.output_token_ids
            elif len(row.output) < n:
                row.output.extend(req.token_ids[req.num_prompt_tokens + len(row.output):])
            row.sampling.grammar = req.grammar
            rows.append(row.sampling)
        return rows

    @staticmethod
    def verify_rows(entries: list[ScheduledRequest]) -> list[SamplingRow]:
        """Sampling rows of a verification step: for each entry ``1 + drafts`` rows, row ``j`` seeing the output
        with the first ``j`` drafts appended (penalties, min_tokens) and the grammar mask at that position."""
        rows = []
        for e in entries:
            req, drafts = e.request, e.draft_token_ids
            output = req.output_token_ids
            for j in range(len(drafts) + 1):
                grammar = req.grammar
                if grammar is not None and drafts:
                    grammar = MaskRow(req.spec_bitmask[j])
                rows.append(SamplingRow(params=req.params, prompt_token_ids=req.prompt_token_ids,
                                        output_token_ids=output + drafts[:j] if j else output,
                                        generator=req.generator, eos_token_ids=req.eos_token_ids, grammar=grammar))
        return rows
