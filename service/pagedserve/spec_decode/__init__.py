"""Speculative decoding: a proposer guesses the next tokens of a request (its drafts), the target model scores
all of them in one forward (1 + drafts positions), and the sampler keeps the longest prefix the target model would
have produced itself, plus one token of its own (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

- :mod:`.proposer`: the :class:`Proposer` interface (a draft-model proposer implements the same method) and
  :class:`NgramProposer` (prompt lookup decoding, Saxena 2023; vLLM's ``ngram`` method).
- :mod:`.grammar`: per-draft-position structured-output masks.
- :mod:`pagedserve.core.sched.drafts`: the scheduler's side (drafts before a step, back-off after rejections,
  acceptance counts).
- The verification itself is :meth:`pagedserve.sample.rejection_sampler.RejectionSampler.verify`.
"""
from .proposer import NgramProposer, Proposer, build_proposer

__all__ = ["NgramProposer", "Proposer", "build_proposer"]
