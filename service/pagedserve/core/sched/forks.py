"""``n > 1`` beside the scheduler: a request's other completions wait until the first has computed the prompt, then
join the waiting queue and share its full prompt blocks through the prefix cache (``fork_parent`` names the first,
whose blocks the KV cache manager looks up for them; :meth:`~pagedserve.core.kv_cache.manager.KVCacheManager
.find_cached_prefix`)."""
from __future__ import annotations

from collections.abc import Callable

from ...request import Request


class ForkWaitList:
    """The n > 1 groups whose other completions wait for the prompt (the scheduler's thread only)."""

    def __init__(self):
        self._groups: list[list[Request]] = []

    def __bool__(self) -> bool:
        return bool(self._groups)

    def add(self, children: list[Request]) -> None:
        """Hold ``children[1:]`` until ``children[0]`` has computed its prompt."""
        for child in children[1:]:
            child.fork_parent = children[0]
        self._groups.append(children)

    def release(self, admit: Callable[[Request], None]) -> None:
        """``admit`` the waiting completions of groups whose first completion has computed its prompt (or ended:
        an aborted group's others are finished too and are dropped here)."""
        still = []
        for children in self._groups:
            first = children[0]
            if first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished:
                for child in children[1:]:
                    if not child.is_finished:
                        admit(child)
            else:
                still.append(children)
        self._groups = still
