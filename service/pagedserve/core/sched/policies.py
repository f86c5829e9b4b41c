"""The narrow interfaces through which the scheduler calls the features beside it (mini-sglang's split of a
scheduler by concern). Each is optional; the scheduler runs plain requests without any of them.

- a gang (``request.gang``, :class:`Gang`): requests scheduled all or none, preempted together, readmitted together;
  its owner (:class:`GangOwner`, beam search's :class:`~.beam_groups.BeamGroups`) hears of preempted members and gets
  the step's next-token log-softmax rows of its members;
- the drafter (:class:`DraftPolicy`, speculative decoding's :class:`~.drafts.Drafter`): drafts before a step,
  acceptance after it;
- n > 1 forking (:class:`~.forks.ForkWaitList`) is the scheduler's own small helper (plain requests only).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ...outputs import CompletionDelta
from ...request import Request
from .output import RequestUpdate


class Gang(Protocol):
    @property
    def members(self) -> list[Request]:
        """Its live requests (contiguous in the scheduler's running list while it runs)."""

    @property
    def seats(self) -> int:
        """Running slots it needs when admitted."""


class GangOwner(Protocol):
    def on_preempted(self, requests: list[Request]) -> None:
        """Requests preempted this step (members among them are recomputed later)."""

    def process(self, rows: dict[Request, torch.Tensor]) -> list[CompletionDelta]:
        """This step's next-token log-softmax rows ``[vocab]`` float32 of members that reached their next token;
        returns the final deltas of gangs that ended."""


class DraftPolicy(Protocol):
    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` (and ``spec_bitmask``) of running requests for this step."""

    def record(self, updates: Iterable[RequestUpdate]) -> None:
        """After the step: the verified drafts' acceptance."""
