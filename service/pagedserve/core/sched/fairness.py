"""Fair shares per caller: the Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024).

Every caller (the API key's name, or a header the operator names: :mod:`pagedserve.serving.callers`) has a counter
of the service it received, in weighted tokens divided by its weight: a prefill token costs
:data:`PREFILL_COST`, a decoded token :data:`DECODE_COST` (the paper's w_p = 1, w_q = 2). Among waiting requests of
the best priority, the next admitted is the earliest (deadline, then arrival) of the backlogged caller with the
smallest counter. A caller that becomes backlogged again (it had nothing queued or running) has its counter lifted
to the smallest counter of the callers that are backlogged (the paper's "counter lift"), so idle time is not banked
as credit to starve the others later. With one caller (or none named) the order is the plain one.
"""
from __future__ import annotations

from collections.abc import Iterable

PREFILL_COST = 1.0
DECODE_COST = 2.0
NO_CALLER = ""   # requests with no caller name share this one


class VirtualTokenCounter:
    """The counters, weights and backlog of the callers one scheduler sees (the engine thread only).

    Args:
        weights: caller name -> weight > 0 (a caller's share of the service is proportional to it); callers not
            named weigh 1.

    Raises:
        ValueError: a weight that is not a positive number (naming ``fair_share_weights``).
    """

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or {})
        for name, w in self.weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
                raise ValueError(f"fair_share_weights: weight of {name!r} must be a number > 0, got {w!r}")
        self.counters: dict[str, float] = {}
        self.live: dict[str, int] = {}            # caller -> its requests waiting or running
        self.served_prefill: dict[str, int] = {}  # caller -> prefill tokens scheduled (metrics)
        self.served_decode: dict[str, int] = {}   # caller -> decode tokens scheduled (metrics)
        self.queue_time_s: dict[str, float] = {}  # caller -> seconds its requests waited for their first step
        self.num_scheduled: dict[str, int] = {}   # caller -> requests that got their first step (metrics)

    def weight(self, caller: str) -> float:
        return float(self.weights.get(caller, 1.0))

    def on_arrival(self, caller: str) -> None:
        """A request of ``caller`` joined the waiting queue (or a preempted one went back: still live)."""
        if self.live.get(caller, 0) == 0:           # newly backlogged: the counter lift
            backlogged = [self.counters.get(c, 0.0) for c, n in self.live.items() if n > 0 and c != caller]
            floor = min(backlogged) if backlogged else max(self.counters.values(), default=0.0)
            self.counters[caller] = max(self.counters.get(caller, 0.0), floor)
        self.live[caller] = self.live.get(caller, 0) + 1

    def on_leave(self, caller: str) -> None:
        """A request of ``caller`` finished (any way)."""
        left = self.live.get(caller, 0) - 1
        if left > 0:
            self.live[caller] = left
        else:
            self.live.pop(caller, None)

    def charge(self, caller: str, prefill_tokens: int, decode_tokens: int) -> None:
        """``caller`` got this many tokens computed in a step."""
        cost = PREFILL_COST * prefill_tokens + DECODE_COST * decode_tokens
        self.counters[caller] = self.counters.get(caller, 0.0) + cost / self.weight(caller)
        self.served_prefill[caller] = self.served_prefill.get(caller, 0) + prefill_tokens
        self.served_decode[caller] = self.served_decode.get(caller, 0) + decode_tokens

    def charge_scheduled(self, scheduled: Iterable) -> None:
        """Charge a step's scheduled entries (``request``, ``num_new_tokens``): the prompt tokens among them as
        prefill, the rest as decode. Charged as soon as they are scheduled, so the next admission sees them."""
        for s in scheduled:
            req = s.request
            prefill = max(0, min(s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens))
            self.charge(req.caller, prefill, s.num_new_tokens - prefill)

    def on_first_scheduled(self, caller: str, waited_s: float) -> None:
        """A request of ``caller`` got its first step after waiting ``waited_s`` seconds (metrics)."""
        self.queue_time_s[caller] = self.queue_time_s.get(caller, 0.0) + waited_s
        self.num_scheduled[caller] = self.num_scheduled.get(caller, 0) + 1

    def prefill_order(self, running: list, head=None) -> list | None:
        """The per-step token budget's share (our extension of VTC from admission to the budget): with requests
        of two or more callers running, the order in which ``running`` (requests with ``caller``, ``priority``,
        ``num_tokens``, ``num_computed_tokens``) takes the budget: decodes (one token left to compute) first in
        their order, then the prefilling requests by (priority, caller's counter, their order), so a light
        caller's prompt chunks are not queued behind a heavy caller's. None when the order stays: one caller among
        ``running`` and the waiting ``head`` (a request, or None)."""
        if len({r.caller for r in running} | ({head.caller} if head is not None else set())) < 2:
            return None

        def key(item):
            i, r = item
            prefilling = r.num_tokens - r.num_computed_tokens > 1
            if not prefilling:
                return (0, 0, 0.0, 0, i)
            return (1, r.priority, *self._rank(r.caller), i)
        return [r for _, r in sorted(enumerate(running), key=key)]

    def ahead(self, a, b) -> bool:
        """Whether waiting request ``a`` (``caller``, ``priority``) comes before running prefill ``b`` for the
        step's budget: a better priority, or the same and another caller with a smaller (counter, live requests)
        (a caller just lifted to the backlogged minimum goes first)."""
        if a.priority != b.priority:
            return a.priority < b.priority
        return a.caller != b.caller and self._rank(a.caller) < self._rank(b.caller)

    def seat_share(self, caller: str, max_num_seqs: int) -> int:
        """``caller``'s share of the ``max_num_seqs`` running seats: in proportion to its weight among the callers
        with requests live (waiting or running), at least 1."""
        total = sum(self.weight(c) for c, n in self.live.items() if n > 0) or 1.0
        return max(1, int(max_num_seqs * self.weight(caller) / total))

    def seat_victim(self, head, running: list, max_num_seqs: int):
        """With every seat taken, the running request to preempt so that the waiting ``head`` (``caller``,
        ``priority``, ``gang``) gets a seat: our extension of VTC from the token budget to the seats, so a light
        caller does not wait for a heavy caller's requests to finish. Only when ``head``'s caller holds fewer seats
        than its :meth:`seat_share`, from the same-priority caller furthest above its own share that ranks after
        ``head``'s (a larger (counter, live requests)); that caller's last request in ``running`` (the least
        progress), never a beam-search gang member. None when no such request exists. A caller at its share is
        never preempted, so two callers cannot take seats back and forth."""
        if head is None or head.gang is not None or len(running) < max_num_seqs:
            return None
        seats: dict[str, int] = {}
        for r in running:
            seats[r.caller] = seats.get(r.caller, 0) + 1
        if seats.get(head.caller, 0) >= self.seat_share(head.caller, max_num_seqs):
            return None
        over = {c: n - self.seat_share(c, max_num_seqs) for c, n in seats.items()
                if c != head.caller and n > self.seat_share(c, max_num_seqs)
                and self._rank(head.caller) < self._rank(c)}
        for caller in sorted(over, key=lambda c: (-over[c], -self.counters.get(c, 0.0))):
            mine = [r for r in running if r.caller == caller and r.gang is None and r.priority == head.priority]
            if mine:
                return mine[-1]
        return None

    def solo_prefill(self, head, running: list, max_num_seqs: int) -> str | None:
        """The caller whose prefills get this step's prefill tokens alone, or None (the usual sharing): the first
        prefill in fair order (the waiting ``head`` when it would be admitted ahead of ``running``'s first prefill,
        else that prefill; ``running`` in :meth:`prefill_order`) when its caller holds fewer seats than its
        :meth:`seat_share`, the new request counted, while another caller has more requests live than its own
        share (a backlog beyond its seats). Its first token then comes after a step of its own prompt and
        the decodes, not after a heavy caller's prompts too (our extension of VTC to the step's latency; a caller
        with its share of seats or more shares steps as before)."""
        first = next((r for r in running if r.num_tokens - r.num_computed_tokens > 1), None)
        new = head is not None and head.gang is None and len(running) < max_num_seqs and \
            (first is None or self.ahead(head, first))
        first = head if new else first
        if first is None:
            return None
        seats = sum(r.caller == first.caller for r in running) + new
        crowded = any(n > self.seat_share(c, max_num_seqs) for c, n in self.live.items() if c != first.caller)
        return first.caller if crowded and seats < self.seat_share(first.caller, max_num_seqs) else None

    def _rank(self, caller: str) -> tuple[float, int]:
        return self.counters.get(caller, 0.0), self.live.get(caller, 0)

    def pick(self, candidates: Iterable[tuple[str, object]]) -> object | None:
        """Of ``(caller, item)`` pairs in queue order (best first), the first item of the caller with the smallest
        counter, ties to the caller with fewer requests live (a caller just lifted to the backlogged minimum goes
        before the one that set it); None when there are none."""
        best, best_key = None, None
        for caller, item in candidates:
            key = self._rank(caller)
            if best_key is None or key < best_key:
                best, best_key = item, key
        return best
