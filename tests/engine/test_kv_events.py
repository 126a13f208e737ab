"""KV events of the bundled engine (issue 38 item 2): vLLM's schema and wire, and a set of
hashes a subscriber rebuilds from the events alone that equals the engine's own prefix
cache after bursts, evictions and resets; the stream ends with ``AllBlocksCleared``.

* the pool alone: stored when a hash's first block is cached, removed when its last goes
  (duplicates of one hash are one entry to a router);
* a real engine publishing on an ipc:// PUB socket with a replay ROUTER: every batch since
  sequence 0 fetched through replay (as a late subscriber does), decoded with vLLM's own
  classes where vLLM is installed, else with ours; the rebuilt set equals the pool's;
* bad ``--kv-events-config``: one line, exit 2; a full queue drops, counts and clears.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import zmq
from click.testing import CliRunner

from kvpool.cli.main import cli
from kvpool.engine import Engine, EngineConfig, EngineConfigError, SamplingParams
from kvpool.engine.block_pool import FixedBlockPool
from kvpool.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventCollector,
)


def rebuild(events: list, cached: set[int] | None = None) -> set[int]:
    """What a router knows: the hashes stored and not removed since the last clear."""
    cached = set() if cached is None else cached
    for e in events:
        name = type(e).__name__
        if name == "BlockStored":
            cached.update(e.block_hashes)
        elif name == "BlockRemoved":
            assert set(e.block_hashes) <= cached, "removed a hash never stored"
            cached.difference_update(e.block_hashes)
        elif name == "AllBlocksCleared":
            cached.clear()
    return cached


def pool_hashes(pool: FixedBlockPool) -> set[int]:
    """The hashes a lookup in ``pool`` can hit."""
    return {e.block_hash for e in pool._entry.values()}


def test_the_pool_reports_first_store_and_last_removal() -> None:
    pool, sink = FixedBlockPool(16), KVEventCollector(1000)
    pool.bind_events(sink, 4)
    seen: list = []
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [11, 12, 13], [[1] * 4, [2] * 4, [3] * 4], 0)
    b = pool.get_new_blocks(1)  # a duplicate of hash 11 (another block, same key)
    pool.cache_full_blocks(b, [11], [[1] * 4], 0)
    events = sink.take()
    seen += events
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].block_hashes == [11, 12, 13] and events[0].parent_block_hash is None
    assert events[0].token_ids == [1] * 4 + [2] * 4 + [3] * 4 and events[0].block_size == 4
    pool.free_blocks(a + b)
    pool.evict_cached_blocks(2)  # a[0] (11, a duplicate remains) and a[1] (12)
    events = sink.take()
    seen += events
    assert [type(e) for e in events] == [BlockRemoved] and events[0].block_hashes == [12]
    assert rebuild(seen) == pool_hashes(pool) == {11, 13}
    pool.evict_cached_blocks(None)
    seen += sink.take()
    assert rebuild(seen) == pool_hashes(pool) == set()


def test_a_full_queue_drops_counts_and_clears() -> None:
    sink = KVEventCollector(3)
    for h in range(5):
        sink.stored([h], None, [h], 1)
    events = sink.take()
    assert [type(e) for e in events] == [AllBlocksCleared, BlockStored]
    assert sink.dropped == 4


def _decoder():  # vLLM's own classes when vLLM is installed, else ours
    try:
        from vllm.distributed.kv_events import KVEventBatch as VllmBatch
    except Exception:  # noqa: BLE001 (no vLLM extra: our schema)
        return msgspec.msgpack.Decoder(KVEventBatch), False
    return msgspec.msgpack.Decoder(VllmBatch), True


def _replay_all(endpoint: str, decoder) -> list:
    """Every batch since sequence 0, through the replay socket (a DEALER: the reply is a
    stream of frames for one request)."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    batches, seqs = [], []
    try:
        while True:
            assert dealer.poll(30_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(seq, "big"))
            batches.append(decoder.decode(payload))
    finally:
        dealer.close(linger=0)
    assert seqs == list(range(len(seqs))), seqs
    return [e for b in batches for e in b.events]


def test_engine_events_rebuild_its_prefix_cache(tiny_dir: Path, tmp_path: Path) -> None:
    pub, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    config = EngineConfig(
        model=str(tiny_dir), kv_cache_size="512KiB", block_size=16, max_num_seqs=8,
        kv_events_config=msgspec.json.encode({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
            "replay_endpoint": replay, "topic": "kv"}).decode())
    engine = Engine(config)
    decoder, _ = _decoder()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub)
    try:
        rng = random.Random(5)
        shared = [rng.randrange(8, 400) for _ in range(48)]  # 3 full blocks, shared
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for burst in range(6):  # bursts with a common prefix; the small cache evicts
            for i in range(6):
                tail = [rng.randrange(8, 400) for _ in range(rng.randrange(16, 120))]
                engine.add_request(shared + tail, sp, f"r{burst}-{i}")
            while engine.has_unfinished():
                engine.step()
            if burst == 3:
                engine.pool.reset_prefix_cache()
        assert engine.pool.num_cached_blocks > 0
        expected = pool_hashes(engine.pool)
        publisher = engine.kv_events
        assert publisher is not None
        _wait_flushed(publisher)
        events = _replay_all(replay, decoder)
        # the stream starts clear (sequence 0): a router replaying a restarted engine's
        # stream forgets what the engine before it had cached
        assert type(events[0]).__name__ == "AllBlocksCleared"
        assert rebuild(events, cached={123456789}) == expected
        assert any(type(e).__name__ == "BlockRemoved" for e in events)  # evictions happened
        assert rebuild(events) == expected
        stored = [e for e in events if type(e).__name__ == "BlockStored"]
        assert all(e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes)
                   for e in stored)
    finally:
        engine.close()
    # the stream ends with a clear: the last batch on the PUB socket (or, for a subscriber
    # that joined late, in the replay before close) ends AllBlocksCleared
    last = None
    while sub.poll(2000):
        _, _, payload = sub.recv_multipart()
        last = decoder.decode(payload)
    sub.close(linger=0)
    assert last is not None, "the subscriber saw nothing (it joined seconds before close)"
    assert type(last.events[-1]).__name__ == "AllBlocksCleared"


def _wait_flushed(publisher) -> None:
    """Until the publisher thread has sent everything the pool reported."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with publisher.collector._lock:
            if not publisher.collector._pending:
                return
        time.sleep(0.02)
    raise AssertionError("events never flushed")


@pytest.mark.parametrize("text, word", [
    ("{", "kv-events-config"),
    ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "endpoint"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm"),
    ('{"unknown_key": 1}', "unknown_key"),
    ('{"publisher": "kafka"}', "publisher"),
])
def test_bad_kv_events_config_is_one_line(tiny_dir: Path, text: str, word: str) -> None:
    with pytest.raises(EngineConfigError, match=word):
        EngineConfig(model=str(tiny_dir), kv_events_config=text)
    r = CliRunner().invoke(cli, ["serve", str(tiny_dir), "--kv-events-config", text])
    assert r.exit_code == 2 and word in r.output and "Traceback" not in r.output, r.output
