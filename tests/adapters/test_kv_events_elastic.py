"""KV events of an elastic bundled engine (issue 38 item 2): when kvpool takes KV back —
a shrink ask (reclaim) or a sleep — the removed blocks are published, so the set a
subscriber rebuilds from the events stays the engine's own prefix cache (empty asleep).
A real daemon, the engine in this process, events fetched through the replay socket."""

from __future__ import annotations

import random

import msgspec

from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine.kv_events import KVEventBatch
from kvpool.engine_adapters.bundled import Settings, enable

from engine.test_kv_events import _replay_all, _wait_flushed, pool_hashes, rebuild


def test_reclaim_and_sleep_publish_what_they_take(tiny_model, start_daemon, tmp_path):
    d = start_daemon(budget="8MiB")
    events_json = msgspec.json.encode({
        "enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
        "replay_endpoint": f"ipc://{tmp_path}/replay"}).decode()
    cfg = EngineConfig(model=str(tiny_model), kv_cache_size="8MiB",
                       kv_events_config=events_json)
    bridge = enable(cfg, Settings(run_dir=str(d.run_dir), name="ev", idle_timeout_s=3600.0))
    engine = Engine(bridge.config, bridge.seams)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        rng = random.Random(3)
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for i in range(24):  # distinct prompts: many cached blocks, none in use after
            engine.add_request([rng.randrange(8, 500) for _ in range(64)], sp, str(i))
        while engine.has_unfinished():
            engine.step()
        before = pool_hashes(engine.pool)
        assert len(before) >= 24 * 4
        policy = engine.pool.policy
        policy.shrink(engine.pool.allocator.holdings().chunk * 2, urgent=False)  # reclaim
        after_shrink = pool_hashes(engine.pool)
        assert after_shrink < before  # the shrink evicted cache
        _wait_flushed(engine.kv_events)
        assert rebuild(_replay_all(f"ipc://{tmp_path}/replay", decoder)) == after_shrink
        with engine.step_lock:
            policy.sleep()
        assert pool_hashes(engine.pool) == set()
        _wait_flushed(engine.kv_events)
        assert rebuild(_replay_all(f"ipc://{tmp_path}/replay", decoder)) == set()
        policy.wake()
    finally:
        engine.close()
