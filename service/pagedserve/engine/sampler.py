"""Batched sampling: one pass over a step's logits ``[B, V]`` picks one token per row.

Order of processing (vLLM / HF-like), each step applied only to the rows (and only when some row) that need it:

0. structured output: rows with a grammar matcher get ``-inf`` on every token their grammar does not allow next
   (:mod:`pagedserve.engine.structured_output`), before anything else, so no later step can bring one back and
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
from typing import NamedTuple

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output.bitmask import apply_bitmask_

_NEG_INF = float("-inf")
_MIN_CANDIDATES = 64  # filters look at this many most likely tokens first (x8 per round for rows that need more)
_WIDEN = 8


class TokenLogprobs(NamedTuple):
    """One sampled (or prompt) token's log-probability under the raw model distribution."""

    token_id: int                    # the token
    logprob: float                   # its natural-log probability
    rank: int                        # 1 + number of tokens strictly more likely (1 = most likely)
    top: list[tuple[int, float]]     # the k most likely (token id, logprob), most likely first


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the step's logits."""

    params: SamplingParams                  # the request's sampling parameters
    prompt_token_ids: Sequence[int]         # the prompt (repetition_penalty counts it)
    output_token_ids: Sequence[int]         # tokens generated so far for this completion
    generator: torch.Generator | None = None  # the row's own CPU generator when seeded (see make_generator)
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)  # the model's EOS ids
    grammar: object | None = None             # structured output: the completion's GrammarMatcher (read, not advanced)


@dataclass
class SamplerOutput:
    """One step's result, one entry per row of the logits."""

    token_ids: list[int]                      # the chosen token of each row
    logprobs: list[TokenLogprobs | None]      # set for rows whose params.logprobs is not None


@dataclass
class VerifyOutput:
    """A verification step's result (:meth:`Sampler.verify`), one entry per request."""

    token_ids: list[list[int]]                  # emitted tokens: the accepted drafts, then the target's own token
    logprobs: list[list[TokenLogprobs | None]]  # one per emitted token (None entries when not asked for)
    num_accepted: list[int]                     # drafts accepted (len(token_ids[i]) - 1)


def make_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` (0 <= seed < 2**64), for one seeded completion."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int],
                     num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Raw log-probabilities of chosen tokens, their rank and the top-k alternatives.

    Args:
        logits: ``[N, V]`` float, unnormalized (log_softmax is taken here, in fp32).
        token_ids: ``[N]`` the token whose logprob is reported for each row.
        num_top: ``N`` ints, how many top alternatives each row lists (0 allowed).

    Returns:
        ``N`` TokenLogprobs. Also used for prompt logprobs (logits of position t, token t + 1).
    """
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device).view(-1, 1)
    chosen = logprobs.gather(1, ids)
    ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
    max_top = min(max(num_top, default=0), logprobs.shape[1])
    top_vals, top_ids = (logprobs.topk(max_top, dim=1) if max_top else (logprobs[:, :0], ids[:, :0]))
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(top_ids[i][:k], top_vals[i][:k])))
            for i, (t, lp, r, k) in enumerate(zip(ids.view(-1).tolist(), chosen.view(-1).tolist(), ranks, num_top))]


class Sampler:
    """Samples one token per row of a step's logits; see the module docstring for the order of processing.

    Args:
        seed: seed of the generator shared by unseeded rows (one per device); None seeds it from the OS.
    """

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Args: logits ``[B, V]`` (fp32; other float dtypes are converted), rows: ``B`` rows, in logits order.
        The logits tensor is not modified. Raises ValueError when the shapes disagree."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        raw = logits.float()
        processed = _process(raw, rows)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not rand:
            token_ids = processed.argmax(dim=-1)
        elif len(rand) == len(rows):
            token_ids = self._sample(processed, rows)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=raw.device)
            greedy = [i for i, r in enumerate(rows) if r.params.greedy]
            if greedy:
                greedy_idx = torch.tensor(greedy, device=raw.device)
                token_ids[greedy_idx] = processed[greedy_idx].argmax(dim=-1)
            rand_idx = torch.tensor(rand, device=raw.device)
            token_ids[rand_idx] = self._sample(processed[rand_idx], [rows[i] for i in rand])
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_row_logprobs(raw, token_ids, rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k / top-p / min-p, inverse transform; ``logits`` ``[n, V]`` (not modified).
        Tokens masked to ``-inf`` (structured output) have probability 0 and are never picked."""
        dist = _distribution(logits, rows)
        return dist.pick(self._uniforms(rows, logits.device))

    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]]) -> VerifyOutput:
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
        processed = _process(raw, rows)
        choice = processed.argmax(dim=-1)                 # the greedy rows' tokens; others overwritten below
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        dist = None
        if rand:
            rand_idx = torch.tensor(rand, device=device)
            dist = _distribution(processed if len(rand) == len(rows) else processed[rand_idx], [rows[i] for i in rand])
            unseeded = [k for k, i in enumerate(rand) if rows[i].generator is None]
            if unseeded:  # rows whose uniforms come from the shared generator: all drawn at once
                u_idx = torch.tensor(unseeded, device=device)
                u = self._uniforms([rows[rand[k]] for k in unseeded], device)
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
        lps = _row_logprobs(raw[emitted_rows], torch.tensor([chosen[i] for i in emitted_rows], device=device),
                            [rows[i] for i in emitted_rows])
        logprobs, pos = [], 0
        for out in tokens:
            logprobs.append(lps[pos:pos + len(out)])
            pos += len(out)
        return VerifyOutput(tokens, logprobs, [len(out) - 1 for out in tokens])

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
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


def _process(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 0 and 2-5 on ``raw`` ``[B, V]`` fp32 (not modified): the processed logits."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    masked = apply_grammars(raw, rows, constrained) if constrained else raw
    processed = apply_logits_processors(masked, rows)
    if constrained and processed is not masked:
        _keep_some_allowed(processed, masked, constrained)
    return processed


class Distribution(NamedTuple):
    """Sampled rows' distributions after steps 7-8, as cumulative sums (what inverse transform sampling needs).

    cdf: ``[n, c]`` float64, non-decreasing: cumulative probability over each row's candidate tokens (dropped ones
        count 0). ids: ``[n, c]`` int64 token ids of the candidates, or None when the candidates are the whole
        vocabulary in order (``c == V``).
    """

    cdf: torch.Tensor
    ids: torch.Tensor | None

    def pick(self, u: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[m]`` int64 tokens for uniforms ``u`` ``[m]`` (float64 in [0, 1)) of ``rows`` (``[m]`` indices into
        the ``n`` rows; None: all, in order): the first candidate whose cumulative probability exceeds ``u`` times
        the row's total, so never a token of probability 0."""
        cdf = self.cdf if rows is None else self.cdf[rows]
        target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
        idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
        if self.ids is None:
            return idx.view(-1)
        ids = self.ids if rows is None else self.ids[rows]
        return ids.gather(1, idx).view(-1)


def _distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> Distribution:
    """Steps 7-8 for sampled rows: ``logits`` ``[n, V]`` (not modified) -> their
    :class:`Distribution`. A row without filters keeps the whole vocabulary in order; a filtered row, the
    candidates :func:`select_candidates` found, most likely first. Each row's order is its own, whatever the
    batch, so a seeded row's token does not depend on the other rows."""
    device = logits.device
    logits = logits / torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    filtered = [i for i, r in enumerate(rows) if r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0.0]
    if not filtered:
        return Distribution(probs.double().cumsum_(dim=-1), None)
    sub = [rows[i] for i in filtered]
    idx = torch.tensor(filtered, device=device)
    every = len(filtered) == len(rows)
    cand_probs, cand_ids, _ = select_candidates(
        logits if every else logits[idx], probs if every else probs[idx],
        torch.tensor([r.params.top_k for r in sub], device=device),
        torch.tensor([r.params.top_p for r in sub], device=device),
        torch.tensor([r.params.min_p for r in sub], device=device))
    if every:
        return Distribution(cand_probs.double().cumsum_(dim=-1), cand_ids)
    # a mixed batch: the filtered rows' candidates padded (probability 0) to the vocabulary's width
    vocab = probs.shape[1]
    ids = torch.arange(vocab, device=device).expand(len(rows), vocab).clone()
    ids[idx] = 0
    ids[idx, :cand_ids.shape[1]] = cand_ids
    probs[idx] = 0.0
    probs[idx, :cand_probs.shape[1]] = cand_probs
    return Distribution(probs.double().cumsum_(dim=-1), ids)


def select_candidates(logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What top-k, then top-p, then min-p keep, with HF's warper semantics (see the module docstring), found among
    each row's most likely tokens: ``_MIN_CANDIDATES`` (or ``max(top_k) + 1``) of them first, and ``_WIDEN`` times
    more, in further rounds, only for rows whose kept set could reach past the candidates (up to a full sort).

    Args:
        logits: ``[n, V]`` fp32, already divided by the temperature.
        probs: ``[n, V]`` ``softmax(logits)``.
        top_k: ``[n]`` int, 0 for off. top_p: ``[n]`` float in (0, 1], 1 for off. min_p: ``[n]`` float in [0, 1],
            0 for off.

    Returns:
        ``(cand_probs, cand_ids, keep)``, all ``[n, c]``: candidates most likely first (rows with fewer candidates
        padded with token 0, probability 0, not kept), ``cand_probs`` the full-softmax probability of each kept
        candidate and 0 for dropped ones, ``keep`` which are kept (a row's most likely token always is).
    """
    n, vocab = logits.shape
    width = min(vocab, max(_MIN_CANDIDATES, int(top_k.max()) + 1))
    todo = torch.arange(n, device=logits.device)
    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    total = probs.sum(dim=-1)
    while todo.numel():
        first = todo.numel() == n   # every row: no copies of the [n, V] tensors
        vals, ids = (logits if first else logits[todo]).topk(width, dim=-1)
        cand = (probs if first else probs[todo]).gather(1, ids)
        keep, covered = _filter_candidates(vals, cand, top_k[todo], top_p[todo], min_p[todo], total[todo],
                                           complete=width == vocab)
        done.append((todo[covered], cand[covered] * keep[covered], ids[covered], keep[covered]))
        todo, width = todo[~covered], min(vocab, width * _WIDEN)
    width = max(p.shape[1] for _, p, _, _ in done)
    out_probs = torch.zeros(n, width, dtype=probs.dtype, device=probs.device)
    out_ids = torch.zeros(n, width, dtype=torch.long, device=probs.device)
    out_keep = torch.zeros(n, width, dtype=torch.bool, device=probs.device)
    for rows, p, i, k in done:
        out_probs[rows, :p.shape[1]], out_ids[rows, :i.shape[1]], out_keep[rows, :k.shape[1]] = p, i, k
    return out_probs, out_ids, out_keep


def _filter_candidates(vals: torch.Tensor, cand: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, total: torch.Tensor, complete: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The filters on ``[n, c]`` candidates sorted by logit (``vals``) with probabilities ``cand``; ``total``
    ``[n]``: each row's full probability mass. Returns ``(keep [n, c] bool, covered [n] bool)``: covered rows keep
    nothing outside the candidates (always, when ``complete``: they are the whole vocabulary)."""
    n, c = vals.shape
    k = top_k.clamp(0, c)     # not complete: c > max(top_k) by construction
    use_k, use_p, use_m = k > 0, top_p < 1.0, min_p > 0.0
    kth = vals.gather(1, (k - 1).clamp(0, c - 1).unsqueeze(1))
    keep = ~((vals < kth) & use_k.unsqueeze(1))                    # top-k: ties with the k-th kept
    kept = cand * keep
    if complete:
        covered = torch.ones(n, dtype=torch.bool, device=vals.device)
    else:
        # top-k bounds a row's set when the candidate after the k-th is strictly lower (no tie reaches past c);
        # without top-k, top-p does when the candidates hold the nucleus' mass (the first token past them would
        # have all of it before it), and min-p when the last candidate is already below the floor.
        after = vals.gather(1, k.clamp(max=c - 1).unsqueeze(1)).squeeze(1)
        by_k = use_k & ((after < kth.squeeze(1)) | kth.squeeze(1).isneginf())
        by_p = use_p & (kept.sum(dim=-1) >= total * top_p)
        by_m = use_m & (cand[:, -1] < cand[:, 0] * min_p)
        covered = torch.where(use_k, by_k, by_p | by_m)
    if bool(use_p.any()):     # top-p reads the top-k-renormalized mass
        threshold = (torch.where(use_k, kept.sum(dim=-1), total) * top_p).unsqueeze(1)
        mass_before = kept.cumsum(dim=-1) - kept
        keep &= (mass_before < threshold) | ~use_p.unsqueeze(1)
    if bool(use_m.any()):     # min-p: a ratio to the most likely token's probability
        keep &= (cand >= (cand[:, 0] * min_p).unsqueeze(1)) | ~use_m.unsqueeze(1)
    keep[:, 0] = True
    return keep, covered


def filter_mask(logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor | None:
    """``[n, V]`` bool, True where top-k, then top-p, then min-p drop a token (:func:`select_candidates` as a
    vocabulary mask), or None when no filter is given. Arguments as there; None for a filter no row uses."""
    if top_k is None and top_p is None and min_p is None:
        return None
    n = logits.shape[0]
    _, cand_ids, keep = select_candidates(
        logits, probs, torch.zeros(n, dtype=torch.long) if top_k is None else top_k,
        torch.ones(n) if top_p is None else top_p, torch.zeros(n) if min_p is None else min_p)
    kept = torch.zeros(probs.shape, dtype=torch.int32, device=probs.device).scatter_add_(1, cand_ids, keep.int())
    return kept == 0   # padding entries (token 0, not kept) add nothing


def apply_grammars(raw: torch.Tensor, rows: list[SamplingRow], constrained: list[int]) -> torch.Tensor:
    """Step 0: a copy of ``raw`` ``[B, V]`` with ``-inf`` where the grammar of a row in ``constrained`` (row
    indices whose ``grammar`` is set) does not allow the token; columns past the tokenizer's vocabulary are
    never allowed. The bitmasks are computed here, from the matchers' current state."""
    from pagedserve.engine.structured_output.grammar import fill_bitmasks  # the grammar library, when used

    bitmask = fill_bitmasks([rows[i].grammar for i in constrained])
    logits = raw.clone()
    if len(constrained) == len(rows):
        apply_bitmask_(logits, bitmask)
    else:
        idx = torch.tensor(constrained, device=raw.device)
        part = logits[idx]
        apply_bitmask_(part, bitmask)
        logits[idx] = part
    return logits


def _keep_some_allowed(processed: torch.Tensor, masked: torch.Tensor, constrained: list[int]) -> None:
    """Constrained rows that steps 2-5 left with no finite logit (``min_tokens`` masking the only allowed stop
    token) take back their masked logits, so the grammar still holds."""
    idx = torch.tensor(constrained, device=processed.device)
    dead = idx[processed[idx].amax(dim=-1).isneginf()]
    if dead.numel():
        processed[dead] = masked[dead]


def apply_logits_processors(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 2-5 of the module docstring on a copy of ``raw`` ``[B, V]``; returns ``raw`` itself when none apply."""
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    banned = [(i, t) for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens
              for t in _min_tokens_banned(r) if t < raw.shape[1]]
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    freq = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if not (bias or banned or rep or freq):
        return raw
    logits = raw.clone()
    device, vocab_size = logits.device, logits.shape[1]
    if bias:
        rows_i, tokens, values = zip(*bias)
        logits.index_put_((torch.tensor(rows_i, device=device), torch.tensor(tokens, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
    if banned:
        rows_i, tokens = zip(*banned)
        logits[torch.tensor(rows_i, device=device), torch.tensor(tokens, device=device)] = _NEG_INF
    flat = logits.view(-1)  # sparse updates: only the (row, token) cells that occur are touched
    if rep:
        cells, _ = _token_cells([rows[i] for i in rep], rep, vocab_size, device, with_prompt=True)
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=device)
        penalty = penalty[_position_of(rep, device)[cells // vocab_size]]
        values = flat[cells]
        flat[cells] = torch.where(values < 0, values * penalty, values / penalty)
    if freq:
        cells, counts = _token_cells([rows[i] for i in freq], freq, vocab_size, device, with_prompt=False)
        where = _position_of(freq, device)[cells // vocab_size]
        presence = torch.tensor([rows[i].params.presence_penalty for i in freq], device=device)[where]
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in freq], device=device)[where]
        flat.index_add_(0, cells, -(frequency * counts.to(flat.dtype) + presence))
    return logits


def _min_tokens_banned(row: SamplingRow) -> set[int]:
    banned = set(row.params.stop_token_ids)
    if not row.params.ignore_eos:
        banned |= row.eos_token_ids
    return banned


def _token_cells(rows: list[SamplingRow], row_ids: list[int], vocab_size: int, device: torch.device,
                 with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct flat cells ``row_id * V + token`` of the tokens in each row's output (and prompt), with counts.

    Returns: ``(cells, counts)``, both ``[m]`` int64.
    """
    parts, lengths = [], []
    for row in rows:
        seqs = (row.prompt_token_ids, row.output_token_ids) if with_prompt else (row.output_token_ids,)
        tensors = [torch.as_tensor(seq, dtype=torch.long).view(-1) for seq in seqs]
        parts.extend(tensors)
        lengths.append(sum(t.numel() for t in tensors))
    tokens = torch.cat(parts).to(device)
    row_of = torch.repeat_interleave(torch.tensor(row_ids, device=device), torch.tensor(lengths, device=device))
    return torch.unique(row_of * vocab_size + tokens, return_counts=True)


def _position_of(row_ids: list[int], device: torch.device) -> torch.Tensor:
    """Lookup table: batch row id -> its position in ``row_ids``."""
    table = torch.zeros(max(row_ids) + 1, dtype=torch.long, device=device)
    table[torch.tensor(row_ids, device=device)] = torch.arange(len(row_ids), device=device)
    return table


def _row_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                  rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return out
    idx = torch.tensor(wanted, device=raw.device)
    entries = compute_logprobs(raw[idx], token_ids[idx], [rows[i].params.logprobs for i in wanted])
    for i, entry in zip(wanted, entries):
        out[i] = entry
    return out
