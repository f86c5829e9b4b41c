"""KV cache manager: ref counts, LRU free queue, prefix-cache chain hashing, lazy eviction, accounting."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagedserve.core.kv_cache.block_pool import NULL_BLOCK, BlockPool
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=16, eos_token_ids=frozenset(), cache_salt=salt)


def check_invariants(kv: KVCacheManager, live: list[Request]) -> None:
    holders: dict[int, int] = {}
    for r in live:
        for b in r.blocks:
            if b is not NULL_BLOCK:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free_ids = {b.block_id for b in kv.pool.free_queue}
    for b in kv.pool.blocks:
        assert b.ref_cnt == holders.get(b.block_id, 0), f"block {b.block_id} ref count"
        assert (b.ref_cnt == 0) == (b.block_id in free_ids)
    assert len(free_ids) == kv.num_free_blocks
    used = sum(1 for b in kv.pool.blocks if b.ref_cnt > 0)
    assert used + kv.num_free_blocks == kv.num_blocks


def test_allocate_and_free_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(r.blocks) == 3 and kv.num_free_blocks == 5
    ids = [b.block_id for b in r.blocks]
    kv.free(r)
    assert kv.num_free_blocks == 8
    # Freed tail first: the tail block is evicted (reused) before the shared-prefix head.
    order = [b.block_id for b in kv.pool.free_queue]
    assert order[-3:] == list(reversed(ids))


def test_allocation_fails_without_changes_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert r.blocks == [] and kv.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    b = make_request("b", list(range(12)))
    hits = kv.find_cached_prefix(b)
    # 12 tokens = 3 full blocks, but at most prompt_len - 1 tokens may come from the cache -> 2 blocks.
    assert len(hits) == 2 and hits == a.blocks[:2]
    assert kv.allocate_slots(b, 12 - 8, hits)
    assert b.num_computed_tokens == 8 and b.blocks[:2] == a.blocks[:2]
    assert b.blocks[2] is not a.blocks[2]
    assert kv.stats.hits_tokens == 8 and kv.stats.queries_tokens == 12
    check_invariants(kv, [a, b])


def test_salt_separates_namespaces():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(12)), salt="x")
    assert kv.allocate_slots(a, 12)
    assert kv.find_cached_prefix(make_request("b", list(range(12)), salt="y")) == []
    assert len(kv.find_cached_prefix(make_request("c", list(range(12)), salt="x"))) == 2


def test_lazy_eviction_keeps_hits_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert len(kv.find_cached_prefix(make_request("b", list(range(9))))) == 2  # still cached while free
    c = make_request("c", list(range(100, 116)))
    assert kv.allocate_slots(c, 16)           # takes every block: the cached ones are evicted
    assert kv.find_cached_prefix(make_request("d", list(range(9)))) == []


def test_hit_on_free_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    kv.free(a)
    b = make_request("b", list(range(9)) + list(range(50, 57)))  # 16 tokens: 2 hits + 2 new blocks > 3
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert not kv.allocate_slots(b, b.num_tokens - 8, hits)
    check_invariants(kv, [])


def test_hash_collision_never_serves_wrong_kv():
    pool = BlockPool(4)
    block = pool.allocate(1)[0]
    pool.cache_block(block, b"h", None, (1, 2, 3, 4))
    assert pool.lookup(b"h", None, (1, 2, 3, 4)) is block
    assert pool.lookup(b"h", None, (9, 9, 9, 9)) is None       # same hash, other tokens
    assert pool.lookup(b"h", b"p", (1, 2, 3, 4)) is None       # same hash, other parent


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "append", "fork", "free", "preempt"]),
                          st.integers(0, 5), st.integers(1, 40), st.integers(0, 2)), max_size=60))
@pytest.mark.parametrize("caching", [True, False])
def test_random_operations_keep_invariants(caching, ops):
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=caching)
    live: list[Request] = []
    counter = 0
    for op, idx, n, prefix in ops:
        if op == "alloc":
            counter += 1
            tokens = [prefix] * 8 + list(range(counter * 100, counter * 100 + n))  # shared 8-token prefixes
            r = make_request(f"r{counter}", tokens)
            hits = kv.find_cached_prefix(r)
            if kv.allocate_slots(r, r.num_tokens - len(hits) * 4, hits):
                r.num_computed_tokens = r.num_tokens
                live.append(r)
        elif live:
            r = live[idx % len(live)]
            if op == "append":
                r.append_output_token(7)
                if kv.allocate_slots(r, 1):
                    r.num_computed_tokens += 1
            elif op == "fork":  # n > 1: a sibling shares r's full prompt blocks, computes the rest privately
                counter += 1
                child = make_request(f"r{counter}", r.prompt_token_ids)
                child.fork_parent = r
                hits = kv.find_cached_prefix(child)
                assert all(b in r.blocks for b in hits)
                if kv.allocate_slots(child, child.num_tokens - len(hits) * 4, hits):
                    child.num_computed_tokens = child.num_tokens
                    live.append(child)
            else:  # free and preempt both release every block; preempt keeps the hashes for the recompute
                kv.free(r)
                live.remove(r)
                r.num_computed_tokens = 0
        check_invariants(kv, live)
        # Nothing shared is written: a block held twice lies wholly inside every holder's computed tokens.
        for r in live:
            for i, b in enumerate(r.blocks):
                if b.ref_cnt > 1:
                    assert (i + 1) * 4 <= r.num_computed_tokens
                    assert not caching or (b.block_hash is not None and len(b.token_ids) == 4)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks


def test_fork_shares_the_partial_block_and_the_first_write_copies_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    b = make_request("b", [0])
    kv.fork(a, b)
    assert b.blocks == a.blocks and b.token_ids == a.token_ids and b.num_computed_tokens == 6
    assert [blk.ref_cnt for blk in a.blocks] == [2, 2]
    assert kv.take_block_copies() == []
    b.append_output_token(9)
    assert kv.blocks_to_allocate([(b, 1)]) == 1
    a.append_output_token(8)
    assert kv.blocks_to_allocate([(b, 1), (a, 1)]) == 1  # one copy: the second writer finds the block private
    a.token_ids.pop()
    assert kv.allocate_slots(b, 1)
    (src, dst), = kv.take_block_copies()
    assert src == a.blocks[1].block_id and dst == b.blocks[1].block_id != src
    assert a.blocks[0] is b.blocks[0] and a.blocks[0].ref_cnt == 2 and a.blocks[1].ref_cnt == 1
    a.append_output_token(8)
    assert kv.allocate_slots(a, 1) and kv.take_block_copies() == []  # the last holder writes in place
    check_invariants(kv, [a, b])
    with pytest.raises(ValueError):
        kv.fork(a, b)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "fork", "free"]),
                          st.integers(0, 7), st.integers(1, 11), st.integers(0, 2)), max_size=60))
@pytest.mark.parametrize("caching", [True, False])
def test_random_forks_with_copy_on_write_keep_invariants(caching, ops):
    """Beam-style forks at any length (partial last blocks shared), appends that copy-on-write, prefix hits and
    frees, against a model of the cache contents: ref counts equal holders, a block is written only while one
    sequence holds it, every computed position holds its token (the copies are applied as the runner does), and
    everything is free at the end."""
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs, enable_prefix_caching=caching)
    content: dict[int, list] = {b.block_id: [None] * bs for b in kv.pool.blocks}
    live: list[Request] = []
    counter = 0

    def compute(r: Request, n: int, hits=None) -> None:
        copies = kv.take_block_copies()
        for src, dst in copies:  # the runner applies them before the forward
            assert kv.pool.blocks[dst].ref_cnt == 1
            content[dst] = list(content[src])
        for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
            block = r.blocks[pos // bs]
            assert block.ref_cnt == 1, "wrote into a shared block"
            content[block.block_id][pos % bs] = r.token_ids[pos]
        r.num_computed_tokens += n

    for op, idx, n, prefix in ops:
        if op == "new":
            counter += 1
            r = make_request(f"r{counter}", [prefix] * 6 + list(range(counter * 100, counter * 100 + n)))
            hits = kv.find_cached_prefix(r)
            todo = r.num_tokens - len(hits) * bs
            if kv.allocate_slots(r, todo, hits):
                compute(r, todo)
                live.append(r)
            assert kv.take_block_copies() == []
        elif live:
            r = live[idx % len(live)]
            if op == "append":
                r.append_output_token(1000 + n)
                if kv.allocate_slots(r, 1):
                    compute(r, 1)
                else:
                    assert kv.take_block_copies() == []
                    r.token_ids.pop()
            elif op == "fork":
                counter += 1
                child = make_request(f"r{counter}", r.prompt_token_ids)
                kv.fork(r, child)
                live.append(child)
            else:
                kv.free(r)
                live.remove(r)
        check_invariants(kv, live)
        for r in live:
            for pos in range(r.num_computed_tokens):
                assert content[r.blocks[pos // bs].block_id][pos % bs] == r.token_ids[pos], (r.request_id, pos)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "append", "chunk", "fork", "free"]),
                          st.integers(0, 7), st.integers(1, 11), st.integers(0, 2)), max_size=50))
@pytest.mark.parametrize("group_windows", [(None, 6), (None, 5, 9), (7,)])
@pytest.mark.parametrize("caching", [True, False])
def test_layer_groups_with_windows_keep_invariants(group_windows, caching, ops):
    """KV layer groups (pagedserve/kv_layout.py): a full group and window groups in one pool, each request's table
    the groups' tables interleaved. Under new requests (prefix hits), chunks, appends with beam forks and frees: ref
    counts equal holders, nothing shared is written, a full group holds every computed position's token, a window
    group every position the next query's window sees (the blocks before it given back as null entries), a prefix
    hit covers whole logical blocks found in every group, and everything is free at the end."""
    bs, G = 4, len(group_windows)
    kv = KVCacheManager(num_blocks=40, block_size=bs, enable_prefix_caching=caching, group_windows=group_windows)
    content: dict[int, list] = {b.block_id: [None] * bs for b in kv.pool.blocks}
    live: list[Request] = []
    counter = 0

    def compute(r: Request, n: int) -> None:
        for src, dst in kv.take_block_copies():
            content[dst] = list(content[src])
        for g, window in enumerate(group_windows):   # what the step's first query reads is there
            first = 0 if window is None else max(0, r.num_computed_tokens - window + 1)
            for pos in range(first, r.num_computed_tokens):
                block = r.blocks[pos // bs * G + g]
                assert block is not NULL_BLOCK and content[block.block_id][pos % bs] == r.token_ids[pos], (g, pos)
        for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
            for g in range(G):
                block = r.blocks[pos // bs * G + g]
                assert block is not NULL_BLOCK and block.ref_cnt == 1, "wrote into a shared or given-back block"
                content[block.block_id][pos % bs] = r.token_ids[pos]
        r.num_computed_tokens += n

    for op, idx, n, prefix in ops:
        if op == "new":
            counter += 1
            r = make_request(f"r{counter}", [prefix] * 9 + list(range(counter * 100, counter * 100 + n)))
            hits = kv.find_cached_prefix(r)
            assert len(hits) % G == 0 and NULL_BLOCK not in hits
            todo = r.num_tokens - kv.num_cached_tokens(hits)
            if kv.allocate_slots(r, todo, hits):
                compute(r, todo)
                live.append(r)
        elif live:
            r = live[idx % len(live)]
            if op in ("append", "chunk"):
                k = 1 if op == "append" else n
                for j in range(k):
                    r.append_output_token(1000 + j)
                if kv.allocate_slots(r, k):
                    compute(r, k)
                else:
                    assert kv.take_block_copies() == []
                    del r.token_ids[-k:]
            elif op == "fork" and n % 2:   # a beam: shares every block, the partial one too
                counter += 1
                child = make_request(f"r{counter}", r.prompt_token_ids)
                kv.fork(r, child)
                live.append(child)
            elif op == "fork":   # an n > 1 sibling: shares the parent's full prompt blocks still held
                counter += 1
                child = make_request(f"r{counter}", r.prompt_token_ids)
                child.fork_parent = r
                hits = kv.find_cached_prefix(child)
                todo = child.num_tokens - kv.num_cached_tokens(hits)
                if kv.allocate_slots(child, todo, hits):
                    compute(child, todo)
                    live.append(child)
            else:
                kv.free(r)
                live.remove(r)
        check_invariants(kv, live)
        for r in live:
            assert len(r.blocks) % G == 0
            for g, window in enumerate(group_windows):
                first = 0 if window is None else max(0, r.num_computed_tokens - window + 1)
                for pos in range(first, r.num_computed_tokens):
                    block = r.blocks[pos // bs * G + g]
                    assert content[block.block_id][pos % bs] == r.token_ids[pos], (r.request_id, g, pos)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks


def test_kv_layout_groups():
    """Layer groups of the released layouts: Gemma 3 (34 layers, every sixth full), gpt-oss (alternating), a
    model without windows or with a window on every layer (one group)."""
    from pagedserve.kv_layout import kv_layout

    gemma3 = kv_layout(tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34)), 34)
    assert gemma3.layers_per_group == 5 and gemma3.group_windows == (None,) + (1024,) * 6
    assert [gemma3.layer_group[i] for i in (5, 11, 17, 23, 29)] == [0] * 5
    assert sorted(zip(gemma3.layer_group, gemma3.layer_slot)) == sorted(set(zip(gemma3.layer_group,
                                                                                 gemma3.layer_slot)))
    oss = kv_layout(tuple(128 if i % 2 == 0 else None for i in range(24)), 24)
    assert oss.layers_per_group == 12 and oss.group_windows == (None, 128) and oss.hybrid
    assert oss.layer_group[:4] == (1, 0, 1, 0) and oss.layer_slot[:4] == (0, 0, 1, 1)
    for windows, want in ((None, (None,)), ((None,) * 4, (None,)), ((16, 32, 16, 8), (32,))):
        one = kv_layout(windows, 4)
        assert one.group_windows == want and one.layers_per_group == 4 and one.layer_slot == (0, 1, 2, 3)
