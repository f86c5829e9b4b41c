"""Beam search parameters and the search itself, on plain values: one step over the live beams' next-token
logprobs picks the continuations to keep and the finished hypotheses.

Semantics are HF transformers' ``generate(num_beams=k, do_sample=False)`` (``GenerationMixin._beam_search``, the
vectorized version of transformers 4.50+): each step takes the top ``K = max(2, 1 + number of stop ids) * k``
candidates ``(beam, token)`` by cumulative logprob over all live beams; the best ``k`` that hit no stop condition go
on; those among the first ``k`` ranks that do hit one (EOS / stop token / stop string / max_tokens) become finished
hypotheses scored ``cumulative_logprob / generated_len ** length_penalty`` (``generated_len`` counts the new token),
of which the best ``k`` are kept. The search ends when ``early_stopping`` is true and ``k`` hypotheses are finished,
when no live beam can beat the worst kept hypothesis (HF's heuristic: the best live beam's score at its current
length), or when no candidate can go on.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..sampling_params import BeamSearchParams

@dataclass(slots=True)
class Candidate:
    """One continuation ``beam + token`` of a step, in rank order."""

    beam: int                      # index of the live beam it extends (into the step's rows)
    token_id: int                  # the new token
    cumulative_logprob: float      # the beam's cumulative logprob plus the token's logprob
    stop: str | None = None        # why it cannot go on: "stop" (EOS, stop token or string), "length"; None: it can
    stop_reason: int | str | None = None  # the stop token id or stop string


@dataclass(slots=True)
class Hypothesis:
    """A finished sequence of the search."""

    output_token_ids: list[int]    # generated tokens, the stop token included
    cumulative_logprob: float      # sum of the generated tokens' logprobs
    score: float                   # cumulative_logprob / len(output_token_ids) ** length_penalty
    finish_reason: str             # "stop" or "length"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchState:
    """What the search keeps between steps (the live beams themselves are the engine's requests)."""

    params: BeamSearchParams
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    improvable: bool = True        # HF's early-stop heuristic is not yet satisfied
    done: bool = False

    def top_candidates(self, logprobs: torch.Tensor, scores: list[float], num_stop_ids: int) -> list[Candidate]:
        """The step's ranked candidates.

        Args:
            logprobs: ``[num_live_beams, vocab]`` float32 next-token log-softmax of each live beam (masked entries
                ``-inf``).
            scores: each live beam's cumulative logprob.
            num_stop_ids: EOS and stop token ids that end a beam (HF keeps ``max(2, 1 + that) * k`` candidates).
        """
        k = self.params.beam_width
        acc = logprobs.float() + torch.tensor(scores, dtype=torch.float32)[:, None]
        flat = acc.reshape(-1)
        num = min(max(2, 1 + num_stop_ids) * k, flat.numel())
        values, indices = torch.topk(flat, num)
        vocab = logprobs.shape[1]
        return [Candidate(int(i) // vocab, int(i) % vocab, float(v)) for v, i in zip(values, indices)
                if v != float("-inf")]

    def advance(self, candidates: list[Candidate], gen_len: int,
                output_of: Callable[[Candidate], list[int]]) -> list[Candidate]:
        """Record the finished candidates among the first beam_width ranks (``stop`` set; ``gen_len``: generated
        tokens after this step; ``output_of(c)``: the candidate's generated tokens, its new token included) and
        return the ones that go on (at most beam_width, best first). Sets :attr:`done` when the search is over."""
        k, lp = self.params.beam_width, self.params.length_penalty
        full_and_early = len(self.finished) == k and self.params.early_stopping
        if self.improvable and not full_and_early:
            for c in candidates[:k]:
                if c.stop is not None:
                    self.finished.append(Hypothesis(output_of(c), c.cumulative_logprob,
                                                    c.cumulative_logprob / gen_len ** lp, c.stop, c.stop_reason))
            self.finished.sort(key=lambda h: -h.score)   # stable: earlier hypotheses win ties, as in HF's topk
            del self.finished[k:]
        going_on = [c for c in candidates if c.stop is None][:k]
        if going_on and len(self.finished) == k:
            best = going_on[0].cumulative_logprob / gen_len ** lp
            self.improvable = self.improvable and best > self.finished[-1].score
        if not going_on or not self.improvable or (len(self.finished) == k and self.params.early_stopping):
            self.done = True
        return going_on
