"""Turns a scheduler step into flat batch tensors, runs the model and samples.

The step's new tokens are laid end to end, decodes (one new token) first, then prefill chunks; for each sequence
the runner builds positions, slot mapping, its block table row and context length (see
:mod:`pagedserve.attention.base`). Logits are computed only for the rows that sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.base import AttentionBackend, AttentionMetadata
from .sampler import Sampler, SamplerOutput, SamplingRow, TokenLogprobs, VerifyOutput, compute_logprobs
from .spec_decode.grammar import MaskRow
from .request import Request
from .scheduler import ScheduledRequest, SchedulerOutput


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``, zeroed."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type for ``EngineConfig.kv_cache_dtype`` ``name``: "auto" is ``model_dtype``,
    otherwise ``torch.<name>``.

    Raises:
        ValueError: naming kv_cache_dtype, a type other than ``model_dtype`` on a non-CPU device (the CUDA kernels
            read and write the cache in the model's dtype only).
    """
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, name)
    if dtype != model_dtype and device.type != "cpu":
        raise ValueError(f"kv_cache_dtype: {name} differs from the model dtype {str(model_dtype).removeprefix('torch.')}; a cache "
                         f"type of its own is supported on CPU only (use auto on {device.type})")
    return dtype


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


PROMPT_LOGPROBS_CHUNK_ROWS = 256  # logits rows materialized at once for prompt logprobs ([rows, vocab] fp32)


def verify_rows(entries: list[ScheduledRequest]) -> list[SamplingRow]:
    """Sampling rows of a verification step: for each entry ``1 + drafts`` rows, row ``j`` seeing the output with
    the first ``j`` drafts appended (penalties, min_tokens) and the grammar mask at that position."""
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


@dataclass(slots=True)
class StepResult:
    sampled: list[ScheduledRequest]      # the scheduled entries that sampled, in the order of `output`'s rows
    output: SamplerOutput | VerifyOutput | None  # None when no row sampled (all prefill chunks); VerifyOutput
                                         # (one entry per sampled request) when some request had drafts
    prompt_logprobs: dict[Request, list[TokenLogprobs]] | None = None  # request -> this step's prompt positions
    pooled: list[ScheduledRequest] = field(default_factory=list)  # pooling requests whose prompt ended this step
    pooled_hidden: torch.Tensor | None = None  # [len(pooled), hidden] float32 CPU: their last tokens' final states
    beam_logprobs: dict[Request, torch.Tensor] | None = None  # beam search beams that sampled -> next-token
                                         # log-softmax [vocab] float32 CPU (not in `sampled`)


class ModelRunner:
    """Owns the model, the KV cache tensors, the attention backend and the sampler.

    Args:
        model: a model with ``forward(input_ids, positions, kv_caches, meta, backend)`` and ``compute_logits``.
        backend: the attention backend.
        kv_caches: from :func:`allocate_kv_caches`.
        block_size: tokens per KV block.
        device: where the model runs.
        seed: seed of the sampler's generator shared by requests without a seed of their own (None: from the OS).
    """

    def __init__(self, model, backend: AttentionBackend, kv_caches, block_size: int, device,
                 seed: int | None = None):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(seed)
        self.compiled = None  # a CompiledForward (engine.compiled, CPU) or CudaGraphForward (engine.cuda_graphs,
                              # CUDA) when the forward runs compiled; None: eager

    def prepare(self, entries: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat ``input_ids [T]``, ``positions [T]`` (int64) and the attention metadata for ``entries``.

        ``entries`` must list decodes (``num_new_tokens == 1``) first.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, starts = [], [], [0]
        max_blocks = max(len(e.request.blocks) for e in entries)
        tables = torch.zeros((len(entries), max_blocks), dtype=torch.int32)
        for i, e in enumerate(entries):
            req, start = e.request, e.request.num_computed_tokens
            end = start + e.num_new_tokens
            input_ids.extend((req.token_ids[start:] + e.draft_token_ids)[:e.num_new_tokens] if e.draft_token_ids
                             else req.token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = [b.block_id for b in req.blocks]
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            tables[i, :len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
            query_lens.append(e.num_new_tokens)
            context_lens.append(end)
            starts.append(starts[-1] + e.num_new_tokens)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_context_len=max(context_lens), num_decode_seqs=num_decodes,
            query_lens_cpu=query_lens, context_lens_cpu=context_lens)
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run one step: forward over all scheduled tokens; logits and sampling for the rows that sample, the final
        hidden state for pooling requests whose prompt is complete."""
        # Decodes first, longest context first (attention backends group decodes of similar length); then the
        # prefill chunks in scheduling order (the sort is stable).
        entries = sorted(sched.scheduled, key=lambda e: (e.num_new_tokens != 1,
                                                         -e.request.num_computed_tokens if e.num_new_tokens == 1 else 0))
        input_ids, positions, meta = self.prepare(entries)
        if sched.block_copies:  # copy-on-write of shared KV blocks, before anything writes them
            self.backend.copy_blocks(self.kv_caches, sched.block_copies)
            on_workers = getattr(self.model, "copy_kv_blocks", None)   # tensor parallelism: each rank's caches
            if on_workers is not None:
                on_workers(sched.block_copies)
        if self.compiled is not None:  # padded to a compiled size; hidden keeps only the step's rows
            hidden = self.compiled(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        prompt_lps = self._prompt_logprobs(entries, hidden)
        sampled, sample_rows, pooled, pooled_rows, pos = [], [], [], [], 0
        for e in entries:
            pos += e.num_new_tokens
            if e.samples:
                (pooled if e.request.pooling else sampled).append(e)
                if e.request.pooling:
                    pooled_rows.append(pos - 1)
                else:  # with drafts: the last known token's row and each draft's row
                    sample_rows.extend(range(pos - 1 - len(e.draft_token_ids), pos))
        pooled_hidden = None
        if pooled:  # last-token pooling over the final (normed) hidden states: HF's last_hidden_state[:, -1]
            pooled_hidden = hidden[torch.tensor(pooled_rows, device=hidden.device)].float().cpu()
        beam_lps = None
        if any(e.request.beam is not None for e in sampled):  # (beams have no drafts: one row each)
            beam_lps, sampled, sample_rows = self._beam_logprobs(hidden, sampled, sample_rows)
        if not sampled:
            return StepResult([], None, prompt_lps, pooled, pooled_hidden, beam_lps)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
        if any(e.draft_token_ids for e in sampled):
            return StepResult(sampled, self.sampler.verify(logits, verify_rows(sampled),
                                                           [e.draft_token_ids for e in sampled]),
                              prompt_lps, pooled, pooled_hidden, beam_lps)
        rows = [SamplingRow(params=e.request.params, prompt_token_ids=e.request.prompt_token_ids,
                            output_token_ids=e.request.output_token_ids, generator=e.request.generator,
                            eos_token_ids=e.request.eos_token_ids, grammar=e.request.grammar) for e in sampled]
        return StepResult(sampled, self.sampler(logits, rows), prompt_lps, pooled, pooled_hidden, beam_lps)

    def _beam_logprobs(self, hidden: torch.Tensor, sampled: list[ScheduledRequest], sample_rows: list[int]):
        """Split beam search rows off: their full next-token log-softmax (fp32, as HF's beam search computes it)
        keyed by request; returns (that, the other sampled entries, their hidden-state rows)."""
        beam_rows, rest, rest_rows, k = [], [], [], 0
        for e in sampled:
            n = 1 + len(e.draft_token_ids)
            if e.request.beam is not None:
                beam_rows.append(sample_rows[k])
            else:
                rest.append(e)
                rest_rows.extend(sample_rows[k:k + n])
            k += n
        logits = self.model.compute_logits(hidden[torch.tensor(beam_rows, device=hidden.device)])
        lps = torch.log_softmax(logits.float(), dim=-1).cpu()
        beams = [e.request for e in sampled if e.request.beam is not None]
        return dict(zip(beams, lps)), rest, rest_rows

    def _prompt_logprobs(self, entries: list[ScheduledRequest], hidden: torch.Tensor):
        """Logprobs of prompt tokens 1..P-1 computed in this step, for requests that asked (``prompt_logprobs=k``).

        Row ``p`` of the chunk (position ``p``) predicts prompt token ``p + 1``. Positions already reported (a
        recompute after preemption) are skipped via ``request.num_prompt_logprobs``.
        """
        out: dict[Request, list[TokenLogprobs]] = {}
        row = 0
        for e in entries:
            req, k = e.request, e.request.params.prompt_logprobs
            start, end = req.num_computed_tokens, req.num_computed_tokens + e.num_new_tokens
            first = max(start, req.num_prompt_logprobs)
            last = min(end, req.num_prompt_tokens - 1)        # the last prompt position predicts an output token
            if k is not None and req.index == 0 and first < last:
                lps: list[TokenLogprobs] = []
                for a in range(first, last, PROMPT_LOGPROBS_CHUNK_ROWS):
                    b = min(a + PROMPT_LOGPROBS_CHUNK_ROWS, last)
                    logits = self.model.compute_logits(hidden[row + a - start:row + b - start])
                    lps.extend(compute_logprobs(logits, req.token_ids[a + 1:b + 1], [k] * (b - a)))
                req.num_prompt_logprobs = last
                out[req] = lps
            row += e.num_new_tokens
        return out or None
