"""Steps 7-9 of the sampler (see :mod:`pagedserve.sample.sampler`): temperature, top-k / top-p / min-p with HF's
warper semantics found among each row's most likely tokens, and inverse-transform picking."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ..sampler import SamplingRow

_MIN_CANDIDATES = 64  # filters look at this many most likely tokens first (x8 per round for rows that need more)
_WIDEN = 8


class SamplingTensors(NamedTuple):
    """Per-row settings of steps 7-8, one entry per row: ``temperature`` ``[n]`` float32, ``top_k`` ``[n]`` int64
    (0: off), ``top_p`` ``[n]`` float32 (1: off), ``min_p`` ``[n]`` float32 (0: off). The worker keeps them per
    request (:class:`pagedserve.worker.input_batch.InputBatch`); :meth:`from_rows` builds them from the rows."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def from_rows(cls, rows: list["SamplingRow"], device: torch.device) -> "SamplingTensors":
        return cls(torch.tensor([r.params.temperature for r in rows], device=device),
                   torch.tensor([r.params.top_k for r in rows], device=device),
                   torch.tensor([r.params.top_p for r in rows], device=device),
                   torch.tensor([r.params.min_p for r in rows], device=device))

    def select(self, idx: torch.Tensor) -> "SamplingTensors":
        """The rows ``idx`` (``[m]`` int64 indices)."""
        return SamplingTensors(*(t.index_select(0, idx) for t in self))


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


def distribution(logits: torch.Tensor, rows: list["SamplingRow"],
                 tensors: SamplingTensors | None = None) -> Distribution:
    """Steps 7-8 for sampled rows: ``logits`` ``[n, V]`` (not modified) -> their
    :class:`Distribution`; ``tensors``: the rows' settings (None: built from ``rows``). A row without filters
    keeps the whole vocabulary in order; a filtered row, the
    candidates :func:`select_candidates` found, most likely first. Each row's order is its own, whatever the
    batch, so a seeded row's token does not depend on the other rows."""
    device = logits.device
    if tensors is None:
        tensors = SamplingTensors.from_rows(rows, device)
    logits = logits / tensors.temperature.unsqueeze(1)
    probs = logits.softmax(dim=-1)
    filtered = [i for i, r in enumerate(rows) if r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0.0]
    if not filtered:
        return Distribution(probs.double().cumsum_(dim=-1), None)
    idx = torch.tensor(filtered, device=device)
    every = len(filtered) == len(rows)
    sub = tensors if every else tensors.select(idx)
    cand_probs, cand_ids, _ = select_candidates(
        logits if every else logits[idx], probs if every else probs[idx], sub.top_k, sub.top_p, sub.min_p)
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
