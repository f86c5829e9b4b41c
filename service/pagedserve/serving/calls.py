"""The API calls in flight over both front ends: new ones refused once shutdown has begun, the count that shutdown
drains. The gRPC interceptor and the HTTP middleware are thin adapters over one :class:`CallTracker`."""
from __future__ import annotations

import asyncio
import time

from .services import Services

SHUTTING_DOWN = "the server is shutting down"


class CallTracker:
    """Counts API calls (streams until their last message) and refuses new ones while ``services`` shut down.

    Args:
        services: the process's services (``shutting_down`` is the gate).
    """

    def __init__(self, services: Services):
        self.services = services
        self.num_in_flight = 0

    def refusal(self) -> str | None:
        """Why a new API call is refused (the front end answers it as unavailable), or None to take it."""
        return SHUTTING_DOWN if self.services.shutting_down else None

    def enter(self) -> None:
        """A call has started (pair with :meth:`leave`)."""
        self.num_in_flight += 1

    def leave(self) -> None:
        """A call has ended (answered, failed or cancelled)."""
        self.num_in_flight -= 1

    async def drain(self, grace_s: float, cut_short: asyncio.Event) -> int:
        """Wait until no call is in flight, ``grace_s`` has passed or ``cut_short`` is set; returns the number of
        calls still in flight then."""
        deadline = time.monotonic() + grace_s
        while self.num_in_flight and time.monotonic() < deadline and not cut_short.is_set():
            try:
                await asyncio.wait_for(cut_short.wait(), min(0.05, max(0.0, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                pass
        return self.num_in_flight
