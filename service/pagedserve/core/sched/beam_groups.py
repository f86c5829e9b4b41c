"""Beam search in the engine: the live beams of a request are engine requests that share KV blocks.

A group starts as one request (the prompt). Whenever all its live beams have their next-token logprobs (usually
the same step; chunked or preempted recomputes may spread them over several), :class:`BeamSearchState` ranks the
candidates (HF semantics, :mod:`~pagedserve.beam_search.ranking`); each kept candidate continues its parent: the first
reuses the parent's request, the others are KV forks of it (every block shared, the partial last block included; the
first write into a shared block copies it, see :class:`~..kv_cache.manager.KVCacheManager`), and beams left without
a continuation release their blocks. When the search ends the best ``n`` hypotheses are sent, best first, as
completions ``0..n-1``: full text and token ids, finish reason and ``cumulative_logprob``, usage on the last.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import torch

from ...beam_search.ranking import BeamSearchState, Candidate, Hypothesis
from ...errors import InvalidInputError
from ...outputs import CompletionDelta, Usage
from ...request import Request, RequestStatus
from ...sampling_params import SamplingParams

log = structlog.get_logger(__name__)


@dataclass(eq=False, slots=True)
class BeamGroup:
    """One beam search request."""

    request_id: str                     # the client's request id
    params: SamplingParams              # with params.beam_search set
    state: BeamSearchState              # hypotheses and the stop heuristic
    beams: list[Request]                # live beams, best first (their running order may differ)
    scores: dict[Request, float] = field(default_factory=dict)  # live beam -> cumulative logprob of its output
    rows: dict[Request, torch.Tensor] = field(default_factory=dict)  # beam -> its next-token logprobs [vocab] fp32
    num_forks: int = 0                  # beams created so far (names them)

    @property
    def width(self) -> int:
        return self.params.beam_search.beam_width

    @property
    def members(self) -> list[Request]:
        """As a scheduler gang: its live beams."""
        return self.beams

    @property
    def seats(self) -> int:
        """As a scheduler gang: the running slots it needs (beam_width)."""
        return self.width


class BeamGroups:
    """Runs the beam groups beside the scheduler (same thread): the scheduler reports preempted beams and hands it
    each step's beam logprob rows (:meth:`~.scheduler.Scheduler.update_from_output`).

    Args:
        scheduler: the engine's scheduler (beams are inserted into and removed from its running list).
        detokenizer: ``detokenizer(params, prompt_token_ids)`` -> a fresh incremental detokenizer (the engine's
            :class:`~pagedserve.core.detokenizer.IncrementalDetokenizer`), for stop strings and the final texts.
        max_model_len: context length at most.
    """

    def __init__(self, scheduler, detokenizer, max_model_len: int):
        self.scheduler = scheduler
        scheduler.gangs = self    # the scheduler's gang owner: preempted beams, each step's logprob rows
        self.kv_cache = scheduler.kv_cache
        self.detokenizer = detokenizer
        self.max_model_len = max_model_len

    def add(self, request_id: str, ids: list[int], params: SamplingParams, eos_token_ids: frozenset[int],
            priority: int = 0, cache_salt: str | None = None) -> BeamGroup:
        """Queue a beam search request as its first beam (the prompt), ``.gang`` set to its new group; returns the
        group (its one live beam: ``beams[0]``).

        A group's beams run together, so beam_width seats and beam_width unshared sequences' blocks (what a
        readmission after preemption may take) must fit.

        Raises:
            InvalidInputError: (``beam_search.beam_width``) more beams than max_num_seqs, or than the KV cache can
                hold at prompt + max_tokens tokens each.
        """
        width = params.beam_search.beam_width
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if width > self.scheduler.max_num_seqs:
            raise InvalidInputError(f"beam_width {width} exceeds max_num_seqs {self.scheduler.max_num_seqs}",
                                    "beam_search.beam_width")
        need = width * self.kv_cache.blocks_needed(len(ids) + max_tokens)
        if need > self.kv_cache.num_blocks:
            raise InvalidInputError(f"beam_width {width} x (prompt + max_tokens = {len(ids) + max_tokens} tokens) "
                                    f"needs up to {need} KV blocks; the cache has {self.kv_cache.num_blocks} "
                                    "(lower max_tokens or beam_width)", "beam_search.beam_width")
        leader = Request(request_id, ids, params, max_tokens, eos_token_ids, priority=priority,
                         cache_salt=cache_salt, parent_id=request_id)
        leader.gang = BeamGroup(request_id, params, BeamSearchState(params.beam_search), [leader], {leader: 0.0})
        self.scheduler.add_request(leader)
        return leader.gang

    def on_preempted(self, requests: list[Request]) -> None:
        """Forget the logprobs of preempted beams (they are recomputed)."""
        for req in requests:
            if req.gang is not None:
                req.gang.rows.pop(req, None)

    def process(self, rows: dict[Request, torch.Tensor]) -> list:
        """Take this step's logprob rows; step every group whose live beams all have theirs. Returns the final
        deltas of the groups that ended."""
        ready = []
        for req, row in rows.items():
            group = req.gang
            if req.is_finished or group is None:
                continue
            group.rows[req] = row
            if len(group.rows) == len(group.beams) and group not in ready:
                ready.append(group)
        deltas = []
        for group in ready:
            try:
                deltas.extend(self._step(group))
            except Exception as exc:  # one request's failure must not take the others down
                log.exception("request_failed", request_id=group.request_id)
                deltas.extend(self.abort(group))
                deltas[-1].error = exc
        return deltas

    def _step(self, group: BeamGroup) -> list:
        beams, params = group.beams, group.params
        rows = torch.stack([self._masked(b, group.rows[b]) for b in beams])
        group.rows.clear()
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(beams[0].eos_token_ids))
        candidates = group.state.top_candidates(rows, [group.scores[b] for b in beams], len(stop_ids))
        gen_len = beams[0].num_output_tokens + 1
        for c in candidates:
            c.stop, c.stop_reason = self._stop_of(beams[c.beam], c.token_id, gen_len)
        going_on = group.state.advance(candidates, gen_len,
                                       lambda c: beams[c.beam].output_token_ids + [c.token_id])
        if group.state.done:
            return self._finish(group)
        self._continue(group, going_on)
        return []

    def _masked(self, beam: Request, row: torch.Tensor) -> torch.Tensor:
        """min_tokens: EOS and stop token ids get -inf until enough tokens exist (HF MinNewTokensLength)."""
        params = beam.params
        if beam.num_output_tokens >= params.min_tokens:
            return row
        ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(beam.eos_token_ids))
        row = row.clone()
        row[torch.tensor(ids, dtype=torch.long)] = float("-inf")
        return row

    def _stop_of(self, beam: Request, token: int, gen_len: int) -> tuple[str | None, int | str | None]:
        """Whether ``beam + token`` must end, and why: ("stop", token or string), ("length", None), or (None, None)."""
        params = beam.params
        can_stop = gen_len > params.min_tokens
        if can_stop and (token in params.stop_token_ids or (not params.ignore_eos and token in beam.eos_token_ids)):
            return "stop", token
        if params.stop:  # decoded afresh: O(output length) per candidate, only for requests with stop strings
            detok = self.detokenizer(params, beam.prompt_token_ids)
            matched = detok.add_tokens(beam.output_token_ids + [token]).stop_str
            if matched is not None:
                return "stop", matched
        if gen_len >= beam.max_tokens or beam.num_tokens + 1 >= self.max_model_len:
            return "length", None
        return None, None

    def _continue(self, group: BeamGroup, going_on: list[Candidate]) -> None:
        """Turn the kept candidates into the next live beams: forks first (they copy the parent before it grows),
        then each appends its token, then beams without a continuation are released."""
        old, chosen, used = group.beams, [], set()
        for c in going_on:
            parent = old[c.beam]
            chosen.append((parent if c.beam not in used else self._fork(group, parent), c))
            used.add(c.beam)
        for req, c in chosen:
            req.append_output_token(c.token_id)
            group.scores[req] = c.cumulative_logprob
        for i, req in enumerate(old):
            if i not in used:
                group.scores.pop(req, None)
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        group.beams = [req for req, _ in chosen]

    def _fork(self, group: BeamGroup, parent: Request) -> Request:
        group.num_forks += 1
        child = Request(f"{group.request_id}#beam{group.num_forks}", parent.prompt_token_ids, parent.params,
                        parent.max_tokens, parent.eos_token_ids, priority=parent.priority,
                        cache_salt=parent.cache_salt, arrival_time=parent.arrival_time, parent_id=group.request_id)
        child.gang = group
        child.first_scheduled_time = parent.first_scheduled_time
        child.num_cached_tokens = parent.num_cached_tokens
        self.kv_cache.fork(parent, child)
        self.scheduler.insert_member(parent, child)
        return child

    def _finish(self, group: BeamGroup) -> list:
        """The best n hypotheses as final deltas (live beams fill in when fewer finished); every beam released."""
        params = group.params
        hyps = list(group.state.finished)
        lp = params.beam_search.length_penalty
        for b in group.beams[:max(0, params.n - len(hyps))]:
            cum = group.scores[b]
            hyps.append(Hypothesis(b.output_token_ids, cum, cum / max(b.num_output_tokens, 1) ** lp, "length"))
        leader = group.beams[0]
        first = min((b.first_scheduled_time for b in group.beams if b.first_scheduled_time is not None),
                    default=None)
        usage = Usage(leader.num_prompt_tokens, sum(len(h.output_token_ids) for h in hyps[:params.n]),
                      max(leader.num_cached_tokens, 0),
                      None if first is None else max(0.0, first - leader.arrival_time))
        self.release(group, RequestStatus.FINISHED_STOPPED)
        deltas = []
        for i, h in enumerate(hyps[:params.n]):
            text = self._final_text(leader, h)
            deltas.append(CompletionDelta(group.request_id, i, text, list(h.output_token_ids),
                                          finish_reason=h.finish_reason, matched_stop=h.stop_reason,
                                          cumulative_logprob=h.cumulative_logprob))
        deltas[-1].usage = usage
        return deltas

    def _final_text(self, leader: Request, h: Hypothesis) -> str:
        """The text a sampled completion with these tokens would have had (stop token not shown, stop string cut)."""
        params = leader.params
        ids = h.output_token_ids
        if isinstance(h.stop_reason, int) and not params.include_stop_str_in_output:
            ids = ids[:-1]
        detok = self.detokenizer(params, leader.prompt_token_ids)
        update = detok.add_tokens(ids)
        return update.text if update.stop_str is not None else update.text + detok.flush()

    def release(self, group: BeamGroup, status: RequestStatus) -> None:
        """End every live beam of the group (blocks freed, out of the scheduler)."""
        for b in group.beams:
            self.scheduler.finish(b, status)
        group.rows.clear()

    def abort(self, group: BeamGroup) -> list:
        """Abort a group: blocks freed; one "abort" delta per requested completion (usage on the last)."""
        leader = group.beams[0]
        self.release(group, RequestStatus.FINISHED_ABORTED)
        deltas = [CompletionDelta(group.request_id, i, finish_reason="abort") for i in range(group.params.n)]
        deltas[-1].usage = Usage(leader.num_prompt_tokens, 0, max(leader.num_cached_tokens, 0))
        return deltas

