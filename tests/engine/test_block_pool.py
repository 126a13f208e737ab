"""FixedBlockPool: states, ref counts, exact prefix-cache hits, eviction, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine import NULL_BLOCK, FixedBlockPool, PoolExhausted


def test_null_block_reserved_and_all_or_nothing():
    pool = FixedBlockPool(5)
    got = pool.get_new_blocks(4)
    assert sorted(got) == [1, 2, 3, 4] and NULL_BLOCK not in got
    with pytest.raises(PoolExhausted):
        pool.get_new_blocks(1)
    pool.free_blocks(got[:2])
    with pytest.raises(PoolExhausted):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2  # the failed call took nothing
    pool.free_blocks(got[2:])
    assert pool.num_used_blocks == 0 and pool.get_usage() == 0.0
    pool.check_integrity()


def test_double_free_is_caught():
    pool = FixedBlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError):
        pool.free_blocks([b])


def test_cached_block_hit_requires_equal_tokens_and_parent():
    pool = FixedBlockPool(8)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [111, 222], [(1, 2), (3, 4)], NULL_BLOCK)
    assert pool.get_cached_block(111, [1, 2], NULL_BLOCK) == a
    assert pool.get_cached_block(222, [3, 4], a) == b
    assert pool.get_cached_block(111, [1, 3], NULL_BLOCK) is None  # same hash, other tokens
    assert pool.get_cached_block(222, [3, 4], NULL_BLOCK) is None  # other parent
    assert pool.get_cached_block(333, [1, 2], NULL_BLOCK) is None  # other hash


def test_freed_cached_blocks_are_evictable_and_reusable():
    pool = FixedBlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:2], [1, 2], [(1,), (2,)], NULL_BLOCK)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 3 and pool.num_cached_blocks == 2
    hit = pool.get_cached_block(1, [1], NULL_BLOCK)
    pool.touch([hit])
    assert pool.ref_count(hit) == 1 and pool.get_num_free_blocks() == 2
    pool.check_integrity()
    new = pool.get_new_blocks(2)  # takes the free block, then evicts the cached one
    assert hit not in new
    assert pool.get_cached_block(2, [2], blocks[0]) is None  # evicted
    pool.free_blocks(new + [hit])
    pool.check_integrity()


def test_evicting_a_parent_invalidates_its_children():
    """Block ids are reused: a child cached after the old content of its parent's id must
    not hit behind the new content of that id."""
    pool = FixedBlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [1, 2], [(1,), (2,)], NULL_BLOCK)
    pool.free_blocks([a, b])  # a freed first: evicted first
    assert pool.evict_cached_blocks(1) == [a]
    assert pool.get_cached_block(2, [2], a) is None  # b is orphaned: its parent is gone
    (a2,) = pool.get_new_blocks(1)
    assert a2 == a  # the id comes back with other content
    pool.cache_full_blocks([a2], [5], [(5,)], NULL_BLOCK)
    assert pool.get_cached_block(2, [2], a2) is None
    pool.free_blocks([a2])
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get", "free", "cache", "hit", "evict"]),
                          st.integers(0, 6)), max_size=60))
def test_random_operations_keep_integrity(ops):
    """Any sequence of pool calls by well-behaved holders keeps the invariants, and
    freeing everything returns every block."""
    pool = FixedBlockPool(9)
    held: list[list[int]] = []
    for op, k in ops:
        if op == "get":
            try:
                held.append(pool.get_new_blocks(k % 4 + 1))
            except PoolExhausted:
                assert pool.get_num_free_blocks() < k % 4 + 1
        elif op == "free" and held:
            pool.free_blocks(reversed(held.pop(k % len(held))))
        elif op == "cache" and held:
            blocks = held[k % len(held)]
            pool.cache_full_blocks(blocks, [hash((k, i)) for i in range(len(blocks))],
                                   [(k, i) for i in range(len(blocks))], NULL_BLOCK)
        elif op == "hit":
            b = pool.get_cached_block(hash((k, 0)), (k, 0), NULL_BLOCK)
            if b is not None:
                pool.touch([b])
                held.append([b])
        elif op == "evict":
            pool.evict_cached_blocks(k)
        pool.check_integrity()
        assert pool.num_used_blocks + pool.get_num_free_blocks() == 8
    for blocks in held:
        pool.free_blocks(reversed(blocks))
    pool.check_integrity()
    assert pool.num_used_blocks == 0
