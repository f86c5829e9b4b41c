"""The pool of physical KV blocks: ref counts, an LRU free queue, and the prefix-cache map (PagedAttention,
Kwon et al. 2023; the eviction policy follows vLLM v1's automatic prefix caching).

Every block exists from start-up. A block whose ref count drops to 0 goes to the tail of the free queue but keeps
its hash, so it stays a prefix-cache hit until it is handed out again (lazy eviction); new blocks come from the head,
so the least recently freed block is reused first.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class KVBlock:
    """One physical block of ``block_size`` token slots in every layer's K and V cache."""

    block_id: int                       # index into the cache tensors' first dimension
    ref_cnt: int = 0                    # block tables holding this block
    block_hash: bytes | None = None     # chain hash once the block is full and cached; None otherwise
    token_ids: tuple[int, ...] = ()     # the tokens whose KV it holds, kept with the hash to rule out collisions
    parent_hash: bytes | None = None    # hash of the previous block in the chain (None for the first block)
    prev_free: "KVBlock | None" = field(default=None, repr=False)  # free-queue links (None when not free)
    next_free: "KVBlock | None" = field(default=None, repr=False)
    in_free_queue: bool = False


#: Stands in a request's block table for a block it gave back because every layer's sliding window has moved past it
#: (:meth:`~.manager.KVCacheManager.allocate_slots`). Not a pool block: the pool never counts, frees or hands it out.
#: Its id, 0, is a real block's, so a kernel that reads the table there reads finite data of another request (masked:
#: no kernel attends to positions before its window).
NULL_BLOCK = KVBlock(0, ref_cnt=1)


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order, with O(1) removal from the middle."""

    def __init__(self, blocks: list[KVBlock]):
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        block.in_free_queue = True
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.in_free_queue, f"block {block.block_id} is not free"
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        if self._head is None:
            raise IndexError("no free KV blocks")
        block = self._head
        self.remove(block)
        return block

    def __iter__(self):
        b = self._head
        while b is not None:
            yield b
            b = b.next_free


class BlockPool:
    """All KV blocks, their ref counts and the hash -> block map of cached full blocks.

    Args:
        num_blocks: physical blocks in the cache (>= 1).
        enable_caching: keep full blocks' hashes for prefix-cache hits.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (evictable cached blocks included)."""
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes.

        Raises:
            ValueError: fewer than ``n`` free blocks (callers check :attr:`num_free_blocks` first).
        """
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a fork); revives free cached blocks."""
        for b in blocks:
            if b is NULL_BLOCK:
                continue
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 go to the free queue's tail.
        :data:`NULL_BLOCK` entries are skipped (as by :meth:`touch`)."""
        for b in blocks:
            if b is NULL_BLOCK:
                continue
            if b.ref_cnt <= 0:
                raise AssertionError(f"double free of KV block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def lookup(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block for this chain position, or None. Compares tokens and parent too, not just the hash."""
        b = self.cached.get(block_hash)
        if b is None or b.token_ids != token_ids or b.parent_hash != parent_hash:
            return None
        return b

    def cache_block(self, block: KVBlock, block_hash: bytes, parent_hash: bytes | None,
                    token_ids: tuple[int, ...]) -> None:
        """Record a full block under its chain hash. A hash already cached by another block keeps that one."""
        if not self.enable_caching or block.block_hash is not None or block is NULL_BLOCK:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached.setdefault(block_hash, block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
