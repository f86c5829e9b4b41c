"""Speculative decoding's verification: the drafts the target model accepts, plus one token of its own."""
from __future__ import annotations

import torch

from ..outputs import VerifyOutput
from .ops.logprobs import row_logprobs
from .ops.topk_topp import SamplingTensors, distribution
from .sampler import Sampler, SamplingRow, process_logits


class RejectionSampler:
    """Verifies drafts with the same processing and random streams as :class:`~.sampler.Sampler` (whose shared
    generator it uses), so a verified step emits what plain steps would have."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
               tensors: SamplingTensors | None = None) -> VerifyOutput:
        """Speculative decoding's verification: per request, the drafts the target model accepts plus one token.

        Rejection sampling with the draft as a point mass (Leviathan et al. 2023, Chen et al. 2023: with a draft
        distribution ``q = delta_t``, draft ``t`` is accepted with probability ``min(1, p(t) / q(t)) = p(t)``, and a
        rejection resamples from ``norm(max(0, p - q))``, which is ``p`` with ``t`` removed, renormalized), realized
        by coupling: at each position the token a plain step would pick, ``x ~ p`` by inverse transform with a
        fresh uniform (or the argmax, greedy), is computed; the draft is accepted iff ``x == t``, which happens
        with probability ``p(t)``, and on a rejection ``x`` is the resample, distributed as ``p`` without ``t``. So
        every emitted token has exactly the target distribution given the tokens before it; greedy output equals a
        plain step's; and a seeded request draws one uniform per emitted token from its generator, as plain steps
        do, so its tokens are the same with and without speculation. ``p`` is the distribution a plain
        step samples from (structured-output mask, logit_bias, min_tokens, penalties, temperature, top-k/p, min-p),
        computed at each position from the output with the earlier drafts appended.

        Args:
            logits: ``[R, V]`` (fp32; other float dtypes converted): for each request ``1 + len(drafts[i])``
                consecutive rows, row ``j`` predicting the token after draft ``j`` (row 0: after the known tokens).
            rows: ``R`` rows: each request's :class:`SamplingRow` per position, ``output_token_ids`` extended by the
                drafts before that position and ``grammar`` the mask at that position.
            drafts: the draft token ids of each request.
            tensors: the rows' settings (None: built from ``rows``).

        Returns:
            :class:`VerifyOutput`: per request the emitted tokens (the accepted drafts, then the target model's
            token) and their raw logprobs where asked for.

        Raises:
            ValueError: the row count is not ``sum(1 + len(d))``.
        """
        num_rows = sum(1 + len(d) for d in drafts)
        if logits.dim() != 2 or logits.shape[0] != len(rows) or len(rows) != num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} / {len(rows)} rows do not match {num_rows} positions")
        raw = logits.float()
        device = raw.device
        processed = process_logits(raw, rows)
        choice = processed.argmax(dim=-1)                 # the greedy rows' tokens; others overwritten below
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        dist = None
        if rand:
            rand_idx = torch.tensor(rand, device=device)
            every = len(rand) == len(rows)
            sub = None if tensors is None else tensors if every else tensors.select(rand_idx)
            dist = distribution(processed if every else processed[rand_idx], [rows[i] for i in rand], sub)
            unseeded = [k for k, i in enumerate(rand) if rows[i].generator is None]
            if unseeded:  # rows whose uniforms come from the shared generator: all drawn at once
                u_idx = torch.tensor(unseeded, device=device)
                u = self.sampler.uniforms([rows[rand[k]] for k in unseeded], device)
                choice[rand_idx[u_idx]] = dist.pick(u, u_idx)
        chosen = choice.tolist()
        where = {i: k for k, i in enumerate(rand)}
        tokens, emitted_rows, start = [], [], 0
        for d in drafts:
            out = []
            for j in range(len(d) + 1):
                i = start + j
                row = rows[i]
                if row.generator is not None and not row.params.greedy:  # seeded: drawn only when reached
                    u = torch.rand(1, dtype=torch.float64, generator=row.generator).to(device)
                    chosen[i] = int(dist.pick(u, torch.tensor([where[i]], device=device))[0])
                out.append(chosen[i])
                emitted_rows.append(i)
                if j == len(d) or chosen[i] != d[j]:
                    break
            tokens.append(out)
            start += len(d) + 1
        lps = row_logprobs(raw[emitted_rows], torch.tensor([chosen[i] for i in emitted_rows], device=device),
                            [rows[i] for i in emitted_rows])
        logprobs, pos = [], 0
        for out in tokens:
            logprobs.append(lps[pos:pos + len(out)])
            pos += len(out)
        return VerifyOutput(tokens, logprobs, [len(out) - 1 for out in tokens])
