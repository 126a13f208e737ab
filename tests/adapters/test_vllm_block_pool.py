"""The elastic vLLM block pool in-process: vLLM's real BlockPool code, a real daemon."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from kvpool.client_lib import ElasticBlockAllocator  # noqa: E402
from kvpool.engine_adapters.vllm import bridge as bridge_mod  # noqa: E402
from kvpool.engine_adapters.vllm.block_pool import VllmElasticPool  # noqa: E402
from kvpool.engine_adapters.vllm.settings import AdapterError, Settings  # noqa: E402

PAGE = 64 << 10
BLOCK = 32 << 10  # two blocks per page: one chunk = one page of each of 2 regions


@pytest.fixture
def pool(start_daemon):
    d = start_daemon(budget="1MiB", page_size=PAGE)
    b = bridge_mod.VllmBridge(Settings(run_dir=str(d.run_dir), idle_timeout_s=0))
    b.connect("unit")
    group = b.tenant.region_group(2, 16 * BLOCK)
    b.allocator = ElasticBlockAllocator(group, BLOCK, low=0, high=0, idle_timeout_s=60)
    assert b.allocator.alloc(1) == [0]
    p = VllmElasticPool(b.allocator.num_blocks, enable_caching=True, hash_block_size=16,
                         bridge=b)
    yield p
    b.close()


def test_a_scheduler_without_the_kv_cache_is_refused():
    no_kv = bridge_mod.VllmBridge(Settings())  # this process allocated no KV cache
    with pytest.raises(AdapterError, match="without the KV"):
        VllmElasticPool(8, enable_caching=True, hash_block_size=16, bridge=no_kv)


def test_only_mapped_blocks_count_and_growth_is_asked_for(pool):
    a = pool.allocator
    assert pool.get_num_free_blocks() == a.free_blocks  # the null block's chunk only
    assert pool.get_num_free_blocks() < a.num_blocks - 1
    assert pool.grow(6)
    assert pool.get_num_free_blocks() >= 6
    blocks = pool.get_new_blocks(6)
    assert sorted(b.block_id for b in blocks) == sorted(set(b.block_id for b in blocks))
    assert 0 not in [b.block_id for b in blocks] and all(b.ref_cnt == 1 for b in blocks)
    pool.check_integrity()
    pool.free_blocks(blocks)  # no hash: straight back to kvpool
    assert pool.free_block_queue.num_free_blocks == 0
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.get_new_blocks(pool.get_num_free_blocks() + 1)


def test_growth_adds_to_the_free_blocks_already_there(pool):
    """A shortfall of one block while the allocator has free blocks: the pool ends with at
    least one more free block than before (taking an already free block gains nothing)."""
    before = pool.get_num_free_blocks()
    assert before > 0  # the null block's chunk has another block
    assert pool.grow(1)
    assert pool.get_num_free_blocks() >= before + 1  # (whole chunks: maybe more)
    pool.check_integrity()


def test_cached_blocks_stay_evictable_and_shrink_empties_whole_chunks(pool):
    assert pool.grow(8)
    blocks = pool.get_new_blocks(8)
    for i, blk in enumerate(blocks):
        h = make_block_hash_with_group_id(bytes([i]) * 8, 0)
        blk.set_block_hash(h)
        pool.cached_block_hash_to_block.insert(h, blk)
    pool.free_blocks(blocks)
    assert pool.free_block_queue.num_free_blocks == 8  # cached: kept, still mapped
    pool.check_integrity()
    held = pool.policy.held_chunks()
    emptied = pool.policy.evict_whole_chunks(2)
    assert emptied == 2 and pool.policy.held_chunks() == held - 2
    left = 8 - pool.policy.shrink_evictions
    assert 0 < left < 8 and pool.free_block_queue.num_free_blocks == left
    assert pool.evict_cached(None) == left
    pool.stash_free()  # (what grow took beyond the 8 blocks)
    pool.check_integrity()
    assert pool.policy.held_chunks() == 1  # the null block's


@pytest.fixture
def manager(pool, monkeypatch):
    """vLLM's own KVCacheManager over the elastic pool, its allocate_slots wrapped as the
    plugin wraps it (16 blocks of 16 tokens of virtual capacity, 2 blocks per chunk)."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_coordinator, kv_cache_manager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvpool.engine_adapters.vllm.block_pool import allocate_slots

    pool.bridge.close()  # the manager builds its own pool over the same allocator
    b = bridge_mod.VllmBridge(pool.bridge.settings)
    b.connect("unit-mgr")
    b.allocator = ElasticBlockAllocator(b.tenant.region_group(2, 16 * BLOCK), BLOCK, low=0,
                                        high=0, idle_timeout_s=60)
    assert b.allocator.alloc(1) == [0]
    monkeypatch.setattr(kv_cache_coordinator, "BlockPool",
                        functools.partial(VllmElasticPool, bridge=b))
    cls = kv_cache_manager.KVCacheManager
    monkeypatch.setattr(cls, "allocate_slots", allocate_slots(cls.allocate_slots))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=b.allocator.num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    init_none_hash(sha256)
    m = cls(cfg, max_model_len=512, scheduler_block_size=16, hash_block_size=16)
    m.hasher = get_request_block_hasher(16, sha256)
    yield m
    b.close()


def _request(manager, rid: str, tokens: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(range(tokens)), SamplingParams(max_tokens=8), None,
                   block_hasher=manager.hasher)


def test_a_shortfall_asks_kvpool_for_exactly_the_missing_blocks(manager):
    pool, a = manager.block_pool, manager.block_pool.allocator
    assert isinstance(pool, VllmElasticPool) and a.mapped_chunks == 1  # the null block's
    out = manager.allocate_slots(_request(manager, "r1", 100), 100)  # 7 blocks, 1 mapped
    assert out is not None and len(out.get_block_ids()[0]) == 7
    assert a.mapped_chunks == 4  # 1 + the 3 chunks (2 blocks each) the 6 missing blocks need
    assert pool.get_num_free_blocks() == 0
    pool.check_integrity()
    # More than the virtual capacity: "not now" (None), never an exception, nothing kept.
    assert manager.allocate_slots(_request(manager, "r2", 400), 400) is None
    assert not pool._stash
    pool.check_integrity()
