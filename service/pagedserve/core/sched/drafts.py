"""Speculative decoding beside the scheduler: before each step, drafts for the running requests (with back-off after
rejections); after it, the acceptance counts. The verification itself is
:class:`pagedserve.sample.rejection_sampler.RejectionSampler`."""
from __future__ import annotations

from collections.abc import Iterable

from ...config import SpeculativeConfig
from ...request import Request
from ...spec_decode.grammar import draft_bitmasks
from ...spec_decode.proposer import build_proposer
from .output import RequestUpdate


class Drafter:
    """Proposes each step's drafts and keeps the acceptance statistics.

    Args:
        config: the speculative decoding settings.
        max_model_len: context length at most (drafts leave room for the target model's own token).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.proposer = build_proposer(config)
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0                 # drafts verified since start-up
        self.num_accepted_tokens = 0              # of those, accepted

    def propose(self, running: list[Request]) -> None:
        """Set each running request's drafts for this step (``spec_token_ids``; [] for none). Only decoding requests
        get drafts, never more than could still be emitted (max_tokens, max_model_len leave room for the target
        model's own token after them), none at all when the batch has ``disable_by_batch_size`` requests or more.
        Constrained requests' drafts are cut where the grammar forbids one, and the mask at each draft position is
        kept for the sampler."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) >= limit
        todo, room = [], []
        for req in running:
            req.spec_token_ids, req.spec_bitmask = [], None
            if off or req.pooling or req.gang is not None or req.num_tokens - req.num_computed_tokens != 1:
                continue
            if req.spec_skip > 0:   # backing off after drafts that were all rejected
                req.spec_skip -= 1
                continue
            n = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            if n > 0:
                todo.append(req)
                room.append(n)
        if not todo:
            return
        for req, drafts in zip(todo, self.proposer.propose([r.token_ids for r in todo], room)):
            if drafts and req.grammar is not None:
                drafts, req.spec_bitmask = draft_bitmasks(req.grammar, drafts)
            req.spec_token_ids = drafts

    def record(self, updates: Iterable[RequestUpdate]) -> None:
        """Count a step's verified drafts and set each verified request's back-off (:meth:`backoff`)."""
        for u in updates:
            if u.num_draft_tokens and u.error is None:
                self.num_draft_tokens += u.num_draft_tokens
                self.num_accepted_tokens += u.num_accepted
                self.backoff(u.request, u.num_accepted)

    def backoff(self, req: Request, accepted: int) -> None:
        """After a verification: an accepted draft resets the request's backoff; all rejected doubles it (1, 2, 4...
        steps without drafts, at most ``rejection_backoff_max``)."""
        limit = self.config.rejection_backoff_max
        req.spec_backoff = 0 if accepted or not limit else min(limit, max(1, 2 * req.spec_backoff))
        req.spec_skip = req.spec_backoff


def schedule_drafts(kv_cache, req: Request, n: int, budget: int) -> list[int]:
    """Speculative drafts for a decoding request: as many of ``req.spec_token_ids`` as fit in the step's ``budget``
    (tokens) after its ``n`` known tokens, with KV slots allocated for them in ``kv_cache`` (a KVCacheManager;
    drafts never cause a preemption: without free blocks the request decodes plainly). Returns the scheduled
    drafts ([] for none); clears the proposal."""
    drafts, req.spec_token_ids = req.spec_token_ids, []
    if not drafts or n != req.num_tokens - req.num_computed_tokens:
        return []
    drafts = drafts[:max(0, budget - n)]
    if not drafts or not kv_cache.allocate_slots(req, n + len(drafts)):
        return []
    return drafts
