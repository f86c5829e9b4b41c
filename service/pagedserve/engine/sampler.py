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
9. sampling by the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per token, which picks token
   ``i`` with probability ``probs[i]`` (equivalent to the Gumbel-max trick); ``q = -log(u)``, ``u ~ U[0, 1)``.
   A seeded row draws its ``u`` from its own CPU generator, ``V`` numbers per step, so its tokens do not depend
   on the rest of the batch; the other rows share the sampler's generator on the logits' device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output.bitmask import apply_bitmask_

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny  # floor for the exponential noise, so probs / q never divides by zero
_TOP_P_CANDIDATES = 1024  # top-p looks at this many most likely tokens first (a full sort only when too few)


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
        processed, constrained = _process(raw, rows)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not rand:
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=raw.device)
            greedy = [i for i, r in enumerate(rows) if r.params.greedy]
            if greedy:
                greedy_idx = torch.tensor(greedy, device=raw.device)
                token_ids[greedy_idx] = processed[greedy_idx].argmax(dim=-1)
            rand_idx = torch.tensor(rand, device=raw.device)
            token_ids[rand_idx] = self._sample(processed[rand_idx], [rows[i] for i in rand],
                                               strict=bool(constrained))
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_row_logprobs(raw, token_ids, rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], strict: bool = False) -> torch.Tensor:
        """Temperature, top-k / top-p / min-p, exponential race; ``logits`` ``[n, V]`` (a copy, changed here).
        ``strict``: tokens at ``-inf`` can never win, not even when every finite token's noise is infinite."""
        probs, drop = _distribution(logits, rows)
        noise = self._exponential_noise(rows, probs.shape[1], logits.device)
        return _race(probs, drop, logits.isneginf() if strict else None, noise)

    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]]) -> VerifyOutput:
        """Speculative decoding's verification: per request, the drafts the target model accepts plus one token.

        Rejection sampling with the draft as a point mass (Leviathan et al. 2023, Chen et al. 2023: with a draft
        distribution ``q = delta_t``, draft ``t`` is accepted with probability ``min(1, p(t) / q(t)) = p(t)``, and a
        rejection resamples from ``norm(max(0, p - q))``, which is ``p`` with ``t`` removed, renormalized), realized
        by coupling: at each position the token a plain step would pick, ``x = argmax(p / q)`` with fresh
        exponential noise (or the argmax, greedy), is computed; the draft is accepted iff ``x == t``, which happens
        with probability ``p(t)``, and on a rejection ``x`` is the resample, distributed as ``p`` without ``t``. So
        every emitted token has exactly the target distribution given the tokens before it; greedy output equals a
        plain step's; and a seeded request draws the same ``V`` uniforms per emitted token from its generator as
        plain steps do, so its tokens are the same with and without speculation. ``p`` is the distribution a plain
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
        device, vocab_size = raw.device, raw.shape[1]
        processed, constrained = _process(raw, rows)
        choice = processed.argmax(dim=-1)                 # the greedy rows' tokens; others overwritten below
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs = drop = neg = None
        if rand:
            rand_idx = torch.tensor(rand, device=device)
            logits_rand = processed[rand_idx]
            probs, drop = _distribution(logits_rand, [rows[i] for i in rand])
            neg = logits_rand.isneginf() if constrained else None
            unseeded = [k for k, i in enumerate(rand) if rows[i].generator is None]
            if unseeded:  # rows whose noise comes from the shared generator: all drawn at once
                u_idx = torch.tensor(unseeded, device=device)
                noise = self._exponential_noise([rows[rand[k]] for k in unseeded], vocab_size, device)
                choice[rand_idx[u_idx]] = _race(probs[u_idx], None if drop is None else drop[u_idx],
                                                None if neg is None else neg[u_idx], noise)
        chosen = choice.tolist()
        where = {i: k for k, i in enumerate(rand)}
        tokens, emitted_rows, start = [], [], 0
        for d in drafts:
            out = []
            for j in range(len(d) + 1):
                i = start + j
                row = rows[i]
                if row.generator is not None and not row.params.greedy:  # seeded: drawn only when reached
                    k = where[i]
                    u = torch.rand(vocab_size, generator=row.generator).to(device)
                    noise = u.log_().neg_().clamp_min_(_TINY).unsqueeze(0)
                    chosen[i] = int(_race(probs[k:k + 1], None if drop is None else drop[k:k + 1],
                                          None if neg is None else neg[k:k + 1], noise)[0])
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

    def _exponential_noise(self, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor:
        """``[n, V]`` i.i.d. Exp(1): seeded rows from their own generator, the others from the shared one."""
        uniform = torch.empty(len(rows), vocab_size, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            draw = torch.rand(len(unseeded), vocab_size, device=device, generator=self._generator(device))
            uniform[torch.tensor(unseeded, device=device)] = draw
        for i, row in enumerate(rows):  # unavoidable: one generator per seeded row
            if row.generator is not None:
                uniform[i] = torch.rand(vocab_size, generator=row.generator).to(device)
        # -log(u) with u ~ U[0, 1) is Exp(1) (5x faster than exponential_ on CPU); u = 0 gives +inf: never chosen.
        return uniform.log_().neg_().clamp_min_(_TINY)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = self._generators[device] = torch.Generator(device=device)
            generator.seed() if self._seed is None else generator.manual_seed(self._seed)
        return self._generators[device]


def _process(raw: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, list[int]]:
    """Steps 0 and 2-5 on ``raw`` ``[B, V]`` fp32 (not modified): ``(processed logits, constrained row indices)``."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    masked = apply_grammars(raw, rows, constrained) if constrained else raw
    processed = apply_logits_processors(masked, rows)
    if constrained and processed is not masked:
        _keep_some_allowed(processed, masked, constrained)
    return processed, constrained


def _distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 7-8 for sampled rows: ``logits`` ``[n, V]`` (a copy: divided by the temperature in place) ->
    ``(probs [n, V], drop [n, V] bool or None)``, the full softmax and what top-k / top-p / min-p drop."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device)
    logits.div_(temperature.unsqueeze(1))
    top_k = top_p = min_p = None
    if any(r.params.top_k for r in rows):
        top_k = torch.tensor([r.params.top_k for r in rows], device=device)
    if any(r.params.top_p < 1.0 for r in rows):
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)
    if any(r.params.min_p > 0.0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)
    probs = logits.softmax(dim=-1)
    return probs, filter_mask(logits, probs, top_k, top_p, min_p)


def _race(probs: torch.Tensor, drop: torch.Tensor | None, neg: torch.Tensor | None,
          noise: torch.Tensor) -> torch.Tensor:
    """Step 9: ``argmax(probs / noise)`` over the tokens not in ``drop``; ``neg`` (``[n, V]`` bool, or None): tokens
    masked to ``-inf`` that must never win, not even when every finite token's noise is infinite. All ``[n, V]``;
    returns ``[n]`` int64. Racing over the full-vocabulary probs: renormalizing after filtering would not change
    the argmax."""
    scores = probs / noise
    if drop is not None:
        scores.masked_fill_(drop, -1.0)
    if neg is not None:  # a masked token's score is 0, which an allowed token scores too when its noise is +inf
        scores.masked_fill_(neg, -2.0)
    return scores.argmax(dim=-1)


def filter_mask(logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor | None:
    """Which tokens top-k, then top-p, then min-p drop, with HF's warper semantics (see the module docstring).

    Args:
        logits: ``[n, V]`` fp32, already divided by the temperature.
        probs: ``[n, V]`` ``softmax(logits)``.
        top_k: ``[n]`` int, 0 for off, or None when no row uses it.
        top_p: ``[n]`` float in (0, 1], 1 for off, or None.
        min_p: ``[n]`` float in [0, 1], 0 for off, or None.

    Returns:
        ``[n, V]`` bool, True where a token is dropped (never a row's most likely token), or None if none is.
    """
    drop = None  # top-p / min-p read the full-softmax probs: their criteria are ratios, unchanged by renormalizing
    if top_k is not None:
        k = top_k.clamp(0, logits.shape[1])
        kth = logits.topk(max(int(k.max()), 1), dim=-1).values.gather(1, (k - 1).clamp_min(0).unsqueeze(1))
        drop = (logits < kth) & (k > 0).unsqueeze(1)
    if top_p is not None:
        drop = _top_p_drop(probs, drop, top_p) if drop is None else drop | _top_p_drop(probs, drop, top_p)
    if min_p is not None:
        below = probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        drop = below if drop is None else drop | below
    return drop


def _top_p_drop(probs: torch.Tensor, drop_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """HF top-p on the top-k-renormalized distribution: keep a token iff the mass of the tokens more likely than it
    is below ``top_p`` of the total. Looks at the ``_TOP_P_CANDIDATES`` most likely tokens (one topk, no full-vocab
    sort); only rows whose nucleus is wider than that are sorted in full."""
    kept = probs if drop_k is None else probs.masked_fill(drop_k, 0.0)
    threshold = kept.sum(dim=-1, keepdim=True) * top_p.unsqueeze(1)
    num_candidates = min(kept.shape[1], _TOP_P_CANDIDATES)
    cand_probs, cand_ids = kept.topk(num_candidates, dim=-1)
    drop = _nucleus_drop(cand_probs, cand_ids, threshold, kept.shape[1])
    wide = ((cand_probs.sum(dim=-1) < threshold.view(-1)) & (top_p < 1.0)).nonzero().view(-1)
    if num_candidates < kept.shape[1] and wide.numel():
        sorted_probs, order = kept[wide].sort(dim=-1, descending=True)
        drop[wide] = _nucleus_drop(sorted_probs, order, threshold[wide], kept.shape[1])
    drop[top_p >= 1.0] = False
    return drop


def _nucleus_drop(sorted_probs: torch.Tensor, ids: torch.Tensor, threshold: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """``[n, V]`` drop mask from ``[n, c]`` probs sorted descending, their token ids, and ``[n, 1]`` thresholds;
    tokens outside ``ids`` are dropped."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_before < threshold
    keep[:, 0] = True
    drop = torch.ones(sorted_probs.shape[0], vocab_size, dtype=torch.bool, device=sorted_probs.device)
    return drop.scatter_(1, ids, ~keep)


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
