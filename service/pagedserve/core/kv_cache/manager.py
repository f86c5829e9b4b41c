"""KV cache manager: block tables, prefix-cache lookups and the accounting the scheduler relies on.

Full, immutable blocks are shared through the prefix cache and between ``n > 1`` completions. Beam search also forks a
sequence with all its blocks, its partial last block included (PagedAttention, Kwon et al. 2023, section 4.4): a step
that is about to write into a block held by more than one sequence first gives the writer a private copy
(copy-on-write). The copies are recorded as ``(src, dst)`` block ids, taken by the scheduler with
:meth:`KVCacheManager.take_block_copies` and applied by the model runner before that step's forward, so nothing shared is
ever written. Full blocks are hashed as a
chain ``sha256(parent_hash, token_ids, extra_keys)`` (vLLM v1's automatic prefix caching) and cached as soon as the
step that computes them is scheduled: within one forward, every layer writes the step's K/V before any attention
reads them, so a request scheduled later in the same step may already use them.

Layer groups (:mod:`pagedserve.kv_layout`, vLLM v1's hybrid allocator): with ``G`` groups a request's table holds ``G`` entries
per logical block, entry ``i * G + g`` being block ``i`` of group ``g``, all from the one pool. Each group's blocks
are hashed under the chain hash and the group, so a prefix hit is a run of logical blocks found in every group; a
sliding-window group gives back its blocks behind its window (their entries become :data:`NULL_BLOCK`) while full
groups keep theirs.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from ...request import Request
from .block_pool import NULL_BLOCK, BlockPool, KVBlock


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...], extra_key: str | None) -> bytes:
    """Chain hash of one full block (32 bytes). ``extra_key`` (the request's cache_salt) separates namespaces."""
    h = hashlib.sha256(parent_hash or b"\0")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_key:
        h.update(b"\x01salt:" + extra_key.encode())
    return h.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters in tokens since start-up."""

    queries_tokens: int = 0   # prompt tokens looked up
    hits_tokens: int = 0      # of those, served from cache


class KVCacheManager:
    """Allocates and frees a request's KV blocks.

    Args:
        num_blocks: physical blocks.
        block_size: tokens per block.
        enable_prefix_caching: reuse cached full blocks across requests.
        sliding_window: None, or (one group, every layer of the model having a sliding window) the largest window
            in tokens: the same as ``group_windows=(sliding_window,)``.
        group_windows: None (one group: ``(sliding_window,)``), or per layer group (:class:`~pagedserve.kv_layout.KVLayout`) its
            window in tokens, None for full attention. In a window group a block whose tokens are all before the
            window of the step's first query is given back while the request runs (vLLM v1's sliding-window
            manager), its table entry replaced by :data:`NULL_BLOCK`, so the group holds about
            ``window / block_size + 1`` blocks plus the step's new tokens, however long the request runs. Given-back
            blocks keep their prefix-cache hash until reused; a later request's hit is the leading run of blocks
            still cached in every group (a block reused since is a miss from there on, never a wrong hit).

    Raises:
        ValueError: ``block_size`` < 1, a window < 1, or both ``sliding_window`` and ``group_windows`` given.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, group_windows: tuple[int | None, ...] | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if group_windows is not None and sliding_window is not None:
            raise ValueError("give sliding_window or group_windows, not both")
        windows = tuple(group_windows) if group_windows is not None else (sliding_window,)
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"sliding windows must be None or >= 1, got {windows}")
        self.group_windows = windows
        self.num_groups = len(windows)
        self.sliding_window = windows[0] if len(windows) == 1 else None
        self.num_window_freed_blocks = 0  # blocks given back behind a sliding window since start-up
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.stats = PrefixCacheStats()
        self._block_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) block ids not yet taken

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def reset_stats(self) -> None:
        self.stats = PrefixCacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        """Table entries (pool blocks, one per group per logical block) that ``num_tokens`` tokens take at most."""
        return self._logical(num_tokens) * self.num_groups

    def _logical(self, num_tokens: int) -> int:
        """Logical blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _key(self, block_hash: bytes, group: int) -> bytes:
        """The prefix-cache key of a block of ``group`` under chain hash ``block_hash`` (group 0: the hash)."""
        return block_hash if group == 0 else block_hash + bytes([group % 256, group // 256])

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Blocks a new (or preempted) request can take instead of computing, leaving at least one token to compute.

        For an ``n > 1`` completion whose ``fork_parent`` still holds its prompt blocks, these are the parent's full
        prompt blocks (shared whether or not prefix caching is on). Otherwise the longest chain of cached full blocks
        matching the request's tokens. Counts the lookup in :attr:`stats`.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent, G = request.fork_parent, self.num_groups
        if parent is not None and parent.blocks:
            shareable = min(parent.num_computed_tokens, parent.num_prompt_tokens) // self.block_size
            hits = parent.blocks[:min(max_blocks, shareable) * G]
            if NULL_BLOCK in hits:   # the parent's window has moved past blocks the child's prefix needs
                hits = []
        elif self.enable_prefix_caching and request.params.prompt_logprobs is None:
            # (prompt logprobs need every prompt position computed, so such requests skip the cache, as in vLLM)
            hits = self._lookup_chain(request, max_blocks)
        else:
            return []
        self.stats.queries_tokens += request.num_prompt_tokens
        self.stats.hits_tokens += min(len(hits) // G * self.block_size, request.num_prompt_tokens)
        return hits

    def num_cached_tokens(self, cached_blocks: list[KVBlock]) -> int:
        """Tokens that the hit ``cached_blocks`` (from :meth:`find_cached_prefix`: ``num_groups`` entries per
        logical block) cover."""
        return len(cached_blocks) // self.num_groups * self.block_size

    def _lookup_chain(self, request: Request, max_blocks: int) -> list[KVBlock]:
        hits: list[KVBlock] = []
        parent = None
        for i in range(max_blocks):
            tokens = tuple(request.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = request.block_hashes[i] if i < len(request.block_hashes) else \
                hash_block(parent, tokens, request.cache_salt)
            found = [self.pool.lookup(self._key(h, g), parent, tokens) for g in range(self.num_groups)]
            if None in found:
                break
            hits.extend(found)
            parent = h
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[KVBlock] | None = None) -> bool:
        """Make the block table cover ``num_computed_tokens (+ cached) + num_new_tokens`` tokens.

        ``cached_blocks`` (from :meth:`find_cached_prefix`, only for a request with no blocks yet) are taken first
        and advance ``request.num_computed_tokens``. Returns False, changing nothing, when too few blocks are free.
        """
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) // self.num_groups * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(request.blocks) - len(cached_blocks)
        # Cached hits sitting in the free queue count as free now but stop being free once touched.
        revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        shared = self._shared_written(request, num_new_tokens)
        if max(num_new_blocks, 0) + len(shared) > self.pool.num_free_blocks - revived:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.blocks.extend(cached_blocks)
            request.num_computed_tokens = num_computed
        for i in shared:
            self._copy_on_write(request, i)
        if num_new_blocks > 0:
            request.blocks.extend(self.pool.allocate(num_new_blocks))
        self._cache_full_blocks(request, total)
        for g, window in enumerate(self.group_windows):
            if window is not None:
                self._free_behind_window(request, g, window)
        return True

    def _free_behind_window(self, request: Request, group: int, window: int) -> None:
        """Give back ``group``'s blocks whose tokens are all before the window of the request's next query (at
        position ``num_computed_tokens``, which sees keys from ``num_computed_tokens - window + 1`` on)."""
        first_needed = max(0, request.num_computed_tokens - window + 1) // self.block_size
        blocks, G = request.blocks, self.num_groups
        for i in range(min(first_needed, len(blocks) // G) - 1, -1, -1):  # newest first: stop at one given back
            e = i * G + group
            if blocks[e] is NULL_BLOCK:
                break
            self.pool.free([blocks[e]])
            blocks[e] = NULL_BLOCK
            self.num_window_freed_blocks += 1

    def num_blocks_held(self, request: Request, group: int | None = None) -> int:
        """Physical blocks in ``request``'s table (entries given back behind a sliding window not counted), in all
        groups or in ``group``'s table only."""
        entries = request.blocks if group is None else request.blocks[group::self.num_groups]
        return sum(1 for b in entries if b is not NULL_BLOCK)

    def blocks_to_allocate(self, plan: list[tuple[Request, int]]) -> int:
        """Blocks that :meth:`allocate_slots` (without cached blocks) for each ``(request, num_new_tokens)`` of
        ``plan``, in order, would take from the pool: new blocks plus copies. A block shared by ``m`` sequences is
        copied at most ``m - 1`` times: its last writer finds it private."""
        num, writers = 0, {}
        for request, n in plan:
            num += max(self.blocks_needed(request.num_computed_tokens + n) - len(request.blocks), 0)
            for i in self._shared_written(request, n):
                block = request.blocks[i]
                writers[block] = writers.get(block, 0) + 1
        return num + sum(min(w, block.ref_cnt - 1) for block, w in writers.items())

    def _shared_written(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices (table entries) of the request's existing blocks that the next ``num_new_tokens`` tokens write
        and that another sequence also holds (a beam fork's partial block): each needs a copy first."""
        if num_new_tokens <= 0:
            return []
        first = request.num_computed_tokens // self.block_size * self.num_groups
        last = min(len(request.blocks), self.blocks_needed(request.num_computed_tokens + num_new_tokens))
        return [i for i in range(first, last) if request.blocks[i].ref_cnt > 1]

    def _copy_on_write(self, request: Request, i: int) -> None:
        """Give ``request`` a private copy of its block ``i``; the copy itself is recorded for the model runner."""
        old = request.blocks[i]
        new = self.pool.allocate(1)[0]
        self._block_copies.append((old.block_id, new.block_id))
        self.pool.free([old])
        request.blocks[i] = new

    def fork(self, parent: Request, child: Request) -> None:
        """Make ``child`` a copy of ``parent`` that shares every block of it, the partial last one included (one
        more reference each); tokens, progress and the block hashes are copied. ``child`` must hold no blocks.

        Raises:
            ValueError: ``child`` already holds blocks.
        """
        if child.blocks:
            raise ValueError(f"fork target {child.request_id!r} already holds KV blocks")
        self.pool.touch(parent.blocks)
        child.blocks = list(parent.blocks)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write ``(src, dst)`` block ids recorded since the last call, in order; clears them."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and register the blocks that are full once ``num_tokens`` tokens are computed."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        bs, G = self.block_size, self.num_groups
        for i in range(request.num_registered_blocks, num_full):
            parent = request.block_hashes[i - 1] if i else None
            tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
            if i == len(request.block_hashes):
                request.block_hashes.append(hash_block(parent, tokens, request.cache_salt))
            for g in range(G):
                self.pool.cache_block(request.blocks[i * G + g], self._key(request.block_hashes[i], g), parent,
                                      tokens)
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Hand back the blocks past the first ``blocks_needed(num_tokens)`` (speculative drafts' slots that were
        rejected). Such tail blocks hold no cached hash: only blocks full of known tokens are registered."""
        keep = max(self._logical(num_tokens), request.num_registered_blocks) * self.num_groups
        if len(request.blocks) > keep:
            self.pool.free(list(reversed(request.blocks[keep:])))
            del request.blocks[keep:]

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first (shared prefixes are evicted last); entries already given
        back behind a sliding window are skipped."""
        self.pool.free(list(reversed(request.blocks)))
        request.blocks = []
        request.num_registered_blocks = 0
