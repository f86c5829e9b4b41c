"""Batched sampling: one pass over a step's logits ``[B, V]`` picks one token per row.

Order of processing (vLLM / HF-like), each step applied only to the rows (and only when some row) that need it:

0. structured output: rows with a grammar matcher get ``-inf`` on every token their grammar does not allow next
   (:mod:`pagedserve.structured_output`), before anything else, so no later step can bring one back and
   the sampled token is always allowed (a row that the later steps would leave with no finite logit at all, e.g.
   ``min_tokens`` masking the only allowed stop token, falls back to its masked logits).
1. logprobs: taken from the RAW model distribution, ``log_softmax(logits)`` before any of the steps below (vLLM's
   default ``raw_logprobs``): the reported logprob, rank and top-k describe what the model predicted, not the
   penalized / biased / tempered / truncated distribution the token was drawn from.
2. ``logit_bias``: the bias is added to the token's logit (OpenAI semantics).
3. ``min_tokens``: while a row has fewer than ``min_tokens`` output tokens, its ``stop_token_ids`` and (unless
   ``ignore_eos``: then EOS ends nothing and stays an ordinary token, as in vLLM) its EOS ids get ``-inf``
   (HF ``MinNewTokensLengthLogitsProcessor``). Applied after the bias so that a bias cannot undo it.
4. ``repetition_penalty`` (CTRL, Keskar et al. 2019; HF ``RepetitionPenaltyLogitsProcessor``): for every token that
   occurs in prompt + output, a positive logit is divided by the penalty, a negative one multiplied.
5. ``presence_penalty`` / ``frequency_penalty`` (OpenAI): over output tokens only,
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
6. greedy rows (temperature 0, or below 1e-5) take the argmax here. The others:
7. temperature: ``logits / temperature``.
8. ``top_k`` (HF ``TopKLogitsWarper``: tokens below the k-th largest logit are dropped, ties kept), then ``top_p``
   (HF ``TopPLogitsWarper``: drop the least likely tokens whose total mass is <= 1 - top_p, the most likely token
   always kept), then ``min_p`` (HF ``MinPLogitsWarper``: drop tokens with prob < min_p * max prob).
9. sampling by inverse transform: one uniform ``u ~ U[0, 1)`` (float64) per row, and the token is the first one
   whose cumulative probability (float64 sums, over the tokens that survive step 8, most likely first when a
   filter ran, else in vocabulary order) exceeds ``u`` times the total: token ``i`` is picked with probability
   ``probs[i] / total`` and a token of probability 0 (dropped, or masked to ``-inf``) never is. Filters look only
   at the most likely candidates (one ``topk``, widened only for rows whose kept set may reach past it), so a
   step costs a softmax and a partial sort instead of vocabulary-sized noise. A seeded row draws its ``u`` from its
   own CPU generator, one number per step, so its tokens do not depend on the rest of the batch; the other rows
   share the sampler's generator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..outputs import SamplerOutput
from ..sampling_params import SamplingParams
from .ops.bitmask import apply_grammars, keep_some_allowed
from .ops.logprobs import row_logprobs
from .ops.penalties import apply_logits_processors
from .ops.topk_topp import SamplingTensors, distribution


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the step's logits."""

    params: SamplingParams                  # the request's sampling parameters
    prompt_token_ids: Sequence[int]         # the prompt (repetition_penalty counts it)
    output_token_ids: Sequence[int]         # tokens generated so far for this completion
    generator: torch.Generator | None = None  # the row's own CPU generator when seeded (see make_generator)
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)  # the model's EOS ids
    grammar: object | None = None             # structured output: the completion's GrammarMatcher (read, not advanced)


def make_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` (0 <= seed < 2**64), for one seeded completion."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Samples one token per row of a step's logits; see the module docstring for the order of processing.

    Args:
        seed: seed of the generator shared by unseeded rows (one per device); None seeds it from the OS.
    """

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 tensors: SamplingTensors | None = None) -> SamplerOutput:
        """Args: logits ``[B, V]`` (fp32; other float dtypes are converted), rows: ``B`` rows, in logits order,
        tensors: their settings (the worker's persistent ones; None: built from ``rows``).
        The logits tensor is not modified. Raises ValueError when the shapes disagree."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        raw = logits.float()
        processed = process_logits(raw, rows)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not rand:
            token_ids = processed.argmax(dim=-1)
        elif len(rand) == len(rows):
            token_ids = self._sample(processed, rows, tensors)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=raw.device)
            greedy = [i for i, r in enumerate(rows) if r.params.greedy]
            if greedy:
                greedy_idx = torch.tensor(greedy, device=raw.device)
                token_ids[greedy_idx] = processed[greedy_idx].argmax(dim=-1)
            rand_idx = torch.tensor(rand, device=raw.device)
            token_ids[rand_idx] = self._sample(processed[rand_idx], [rows[i] for i in rand],
                                               None if tensors is None else tensors.select(rand_idx))
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=row_logprobs(raw, token_ids, rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                tensors: SamplingTensors | None) -> torch.Tensor:
        """Temperature, top-k / top-p / min-p, inverse transform; ``logits`` ``[n, V]`` (not modified).
        Tokens masked to ``-inf`` (structured output) have probability 0 and are never picked."""
        dist = distribution(logits, rows, tensors)
        return dist.pick(self.uniforms(rows, logits.device))

    def uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """``[n]`` float64 i.i.d. U[0, 1): seeded rows from their own generator, the others from the shared one."""
        uniform = torch.empty(len(rows), dtype=torch.float64, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            draw = torch.rand(len(unseeded), dtype=torch.float64, device=device, generator=self._generator(device))
            uniform[torch.tensor(unseeded, device=device)] = draw
        for i, row in enumerate(rows):  # one generator per seeded row
            if row.generator is not None:
                uniform[i] = torch.rand(1, dtype=torch.float64, generator=row.generator)[0]
        return uniform

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = self._generators[device] = torch.Generator(device=device)
            generator.seed() if self._seed is None else generator.manual_seed(self._seed)
        return self._generators[device]


def process_logits(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 0 and 2-5 on ``raw`` ``[B, V]`` fp32 (not modified): the processed logits."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    masked = apply_grammars(raw, rows, constrained) if constrained else raw
    processed = apply_logits_processors(masked, rows)
    if constrained and processed is not masked:
        keep_some_allowed(processed, masked, constrained)
    return processed


