"""Turns a scheduler step into flat batch tensors, runs the model and samples.

The step's new tokens are laid end to end, decodes (one new token) first, then prefill chunks; for each sequence
the input batch (:mod:`.input_batch`) gives positions, slot mapping, its block table row and context length (see
:mod:`pagedserve.attention.base`). Logits are computed only for the rows that sample.
"""
from __future__ import annotations

import torch

from ..attention.base import AttentionBackend
from ..core.sched.output import ScheduledRequest, SchedulerOutput
from ..outputs import StepResult, TokenLogprobs
from ..request import Request
from ..sample.ops.logprobs import compute_logprobs
from ..sample.rejection_sampler import RejectionSampler
from ..sample.sampler import Sampler
from .input_batch import InputBatch


PROMPT_LOGPROBS_CHUNK_ROWS = 256  # logits rows materialized at once for prompt logprobs ([rows, vocab] fp32)


class ModelRunner:
    """Builds each step's batch, runs the forward and LM head through its executor, and samples.

    Args:
        forward: ``forward(input_ids, positions, kv_caches, meta, backend) -> hidden`` (the executor's
            ``execute_model``: the model contract's call, on every rank).
        compute_logits: ``compute_logits(hidden) -> logits`` float32 (the executor's).
        backend: the attention backend.
        kv_caches: this process's KV tensors (:func:`pagedserve.worker.kv_tensors.allocate_kv_caches`).
        block_size: tokens per KV block.
        device: where the model runs.
        seed: seed of the sampler's generator shared by requests without a seed of their own (None: from the OS).
    """

    def __init__(self, forward, compute_logits, backend: AttentionBackend, kv_caches, block_size: int, device,
                 seed: int | None = None):
        self.forward = forward
        self.compute_logits = compute_logits
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.input_batch = InputBatch(block_size, self.device)
        self.sampler = Sampler(seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.compiled = None  # a CompiledForward (worker.compiled, CPU) or CudaGraphForward (worker.cuda_graphs,
                              # CUDA) when the forward runs compiled; None: eager

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run one step (the executor has done its KV block copies): forward over all scheduled tokens; logits
        and sampling for the rows that sample, the final hidden state for pooling requests whose prompt is
        complete."""
        # Decodes first, longest context first (attention backends group decodes of similar length); then the
        # prefill chunks in scheduling order (the sort is stable).
        entries = sorted(sched.scheduled, key=lambda e: (e.num_new_tokens != 1,
                                                         -e.request.num_computed_tokens if e.num_new_tokens == 1 else 0))
        input_ids, positions, meta = self.input_batch.prepare(entries)
        if self.compiled is not None:  # padded to a compiled size; hidden keeps only the step's rows
            hidden = self.compiled(input_ids, positions, meta)
        else:
            hidden = self.forward(input_ids, positions, self.kv_caches, meta, self.backend)
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
        logits = self.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
        if any(e.draft_token_ids for e in sampled):
            output = self.rejection_sampler.verify(logits, InputBatch.verify_rows(sampled),
                                                   [e.draft_token_ids for e in sampled])
        else:
            output = self.sampler(logits, self.input_batch.sampling_rows(sampled))
        return StepResult(sampled, output, prompt_lps, pooled, pooled_hidden, beam_lps)

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
        logits = self.compute_logits(hidden[torch.tensor(beam_rows, device=hidden.device)])
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
                    logits = self.compute_logits(hidden[row + a - start:row + b - start])
                    lps.extend(compute_logprobs(logits, req.token_ids[a + 1:b + 1], [k] * (b - a)))
                req.num_prompt_logprobs = last
                out[req] = lps
            row += e.num_new_tokens
        return out or None
