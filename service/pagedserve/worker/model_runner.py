"""One step on one rank: scheduler output in, :class:`~pagedserve.outputs.ModelRunnerOutput` out.

The step's new tokens are laid end to end, decodes (one new token) first, then prefill chunks; for each sequence
the input batch (:mod:`.input_batch`) gives positions, slot mapping, its block table row and context length (see
:mod:`pagedserve.attention.base`). Logits are computed only for the rows that sample (and for prompt logprobs).
Under tensor parallelism every rank runs the same calls (the forward's and the LM head's collectives); only the
driver (rank 0), which gets the gathered logits, samples.
"""
from __future__ import annotations

import torch

from ..attention.base import AttentionBackend
from ..outputs import ModelRunnerOutput, TokenLogprobs
from ..sample.ops.logprobs import compute_logprobs
from ..sample.rejection_sampler import RejectionSampler
from ..sample.sampler import Sampler
from ..scheduler_output import SchedulerOutput
from .input_batch import InputBatch, StepEntry


PROMPT_LOGPROBS_CHUNK_ROWS = 256  # logits rows materialized at once for prompt logprobs ([rows, vocab] fp32)


class ModelRunner:
    """Keeps the requests' state, builds each step's batch, runs the forward and the LM head, and samples.

    Args:
        model: this rank's model (:class:`pagedserve.models.interface.CausalLM`).
        backend: the attention backend.
        kv_caches: this rank's KV tensors (:func:`pagedserve.worker.kv_tensors.allocate_kv_caches`).
        block_size: tokens per KV block.
        device: where the model runs.
        seed: seed of the sampler's generator shared by requests without a seed of their own (None: from the OS).
        is_driver: rank 0 (it samples); other ranks only join the collectives.
        kv_layout: the KV layer groups (:class:`~pagedserve.kv_layout.KVLayout`; None: one block table).
    """

    def __init__(self, model, backend: AttentionBackend, kv_caches, block_size: int, device, seed: int | None = None,
                 is_driver: bool = True, kv_layout=None):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.is_driver = is_driver
        self.input_batch = InputBatch(block_size, self.device, kv_layout)
        self.sampler = Sampler(seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.compiled = None  # a CompiledForward (worker.compiled, CPU) or CudaGraphForward (worker.cuda_graphs,
                              # CUDA) when the forward runs compiled; None: eager

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model over the step's tokens: ``[T]`` ids and positions -> ``[T, hidden]`` final hidden states."""
        if self.compiled is not None:  # padded to a compiled size; hidden keeps only the step's rows
            return self.compiled(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head: float32 ``[N, vocab]`` (None on ranks other than the driver)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step: copy-on-write block copies, the forward over all scheduled tokens; logits and sampling for
        the rows that sample, the final hidden state for pooling requests whose prompt is complete. Returns None on
        ranks other than the driver."""
        self.input_batch.update_states(sched)
        if sched.block_copies:
            self.backend.copy_blocks(self.kv_caches, sched.block_copies)
        entries = self.input_batch.entries(sched)
        input_ids, positions, meta = self.input_batch.prepare(entries)
        hidden = self.forward(input_ids, positions, meta)
        out = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(entries, hidden))
        sampled, sample_rows, pooled_rows, beams, beam_rows, pos = [], [], [], [], [], 0
        for e in entries:
            pos += e.num_new_tokens
            if not e.samples:
                continue
            if e.state.pooling:
                out.pooled_req_ids.append(e.state.req_id)
                pooled_rows.append(pos - 1)
            elif e.state.beam_search:   # (beams have no drafts: one row each)
                beams.append(e.state.req_id)
                beam_rows.append(pos - 1)
            else:  # with drafts: the last known token's row and each draft's row
                sampled.append(e)
                sample_rows.extend(range(pos - 1 - len(e.draft_token_ids), pos))
        if pooled_rows:  # last-token pooling over the final (normed) hidden states: HF's last_hidden_state[:, -1]
            out.pooled_hidden = hidden[self._index(pooled_rows)].float().cpu()
        if beam_rows:  # the full next-token log-softmax (fp32, as HF's beam search computes it)
            logits = self.compute_logits(hidden[self._index(beam_rows)])
            if logits is not None:
                out.beam_logprobs = dict(zip(beams, torch.log_softmax(logits.float(), dim=-1).cpu()))
        if sampled:
            logits = self.compute_logits(hidden[self._index(sample_rows)])
            if self.is_driver:
                self._sample(logits, sampled, sched, out)
        return out if self.is_driver else None

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, device=self.device)

    def _sample(self, logits: torch.Tensor, sampled: list[StepEntry], sched: SchedulerOutput,
                out: ModelRunnerOutput) -> None:
        batch = self.input_batch
        out.req_ids = [e.state.req_id for e in sampled]
        if any(e.draft_token_ids for e in sampled):
            counts = [1 + len(e.draft_token_ids) for e in sampled]
            verified = self.rejection_sampler.verify(logits, batch.verify_rows(sampled, sched),
                                                     [e.draft_token_ids for e in sampled],
                                                     batch.sampling_tensors(sampled, counts))
            out.sampled_token_ids, out.logprobs = verified.token_ids, verified.logprobs
            out.num_accepted = verified.num_accepted
            return
        result = self.sampler(logits, batch.sampling_rows(sampled, sched), batch.sampling_tensors(sampled))
        out.sampled_token_ids = [[t] for t in result.token_ids]
        out.logprobs = [[lp] for lp in result.logprobs]
        out.num_accepted = [0] * len(sampled)

    def _prompt_logprobs(self, entries: list[StepEntry], hidden: torch.Tensor) -> dict[int, list[TokenLogprobs]]:
        """Logprobs of prompt tokens 1..P-1 computed in this step, for requests that asked (``prompt_logprobs=k``).

        Row ``p`` of the chunk (position ``p``) predicts prompt token ``p + 1``. Positions already reported (a
        recompute after preemption) are skipped via the state's ``num_prompt_logprobs``.
        """
        out: dict[int, list[TokenLogprobs]] = {}
        row = 0
        for e in entries:
            state, k = e.state, e.state.prompt_logprobs
            start, end = state.num_computed_tokens, state.num_computed_tokens + e.num_new_tokens
            first = max(start, state.num_prompt_logprobs)
            last = min(end, state.num_prompt_tokens - 1)        # the last prompt position predicts an output token
            if k is not None and first < last:
                lps: list[TokenLogprobs] = []
                for a in range(first, last, PROMPT_LOGPROBS_CHUNK_ROWS):
                    b = min(a + PROMPT_LOGPROBS_CHUNK_ROWS, last)
                    logits = self.compute_logits(hidden[row + a - start:row + b - start])
                    if logits is not None:
                        lps.extend(compute_logprobs(logits, state.token_ids[a + 1:b + 1], [k] * (b - a)))
                state.num_prompt_logprobs = last
                out[state.req_id] = lps
            row += e.num_new_tokens
        return out
