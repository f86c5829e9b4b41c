"""Log-probabilities as the API reports them: under the RAW model distribution (vLLM's default ``raw_logprobs``),
with the chosen token's rank and the top-k alternatives."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ...outputs import TokenLogprobs

if TYPE_CHECKING:
    from ..sampler import SamplingRow


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


def row_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                 rows: list["SamplingRow"]) -> list[TokenLogprobs | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return out
    idx = torch.tensor(wanted, device=raw.device)
    entries = compute_logprobs(raw[idx], token_ids[idx], [rows[i].params.logprobs for i in wanted])
    for i, entry in zip(wanted, entries):
        out[i] = entry
    return out
