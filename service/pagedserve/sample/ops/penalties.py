"""Steps 2-5 of the sampler: ``logit_bias``, ``min_tokens``, ``repetition_penalty``, presence / frequency
penalties (see :mod:`pagedserve.sample.sampler` for their order and sources)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..sampler import SamplingRow

_NEG_INF = float("-inf")


def apply_logits_processors(raw: torch.Tensor, rows: list["SamplingRow"]) -> torch.Tensor:
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


def _min_tokens_banned(row: "SamplingRow") -> set[int]:
    banned = set(row.params.stop_token_ids)
    if not row.params.ignore_eos:
        banned |= row.eos_token_ids
    return banned


def _token_cells(rows: list["SamplingRow"], row_ids: list[int], vocab_size: int, device: torch.device,
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
