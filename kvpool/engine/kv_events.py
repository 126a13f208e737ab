"""KV events: the prefix cache's changes, published the way vLLM publishes them, so a
precise-prefix router (llm-d, Dynamo) that subscribes to vLLM engines can subscribe to
this one too (docs/ARCHITECTURE.md, "KV events").

What travels is vLLM's schema (``vllm/distributed/kv_events.py``), rebuilt here with the
same msgspec shapes so vLLM's own classes decode it: a batch is an array ``[ts, events,
data_parallel_rank]``; each event a map tagged ``type``: ``BlockStored{block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}``,
``BlockRemoved{block_hashes, medium}``, ``AllBlocksCleared{}``. The wire is vLLM's too:
a ZeroMQ PUB socket sends ``(topic, seq as 8 bytes big-endian, payload)``; an optional
ROUTER replay socket answers a request carrying a start sequence number with every
buffered batch from there, then ``(b"", seq -1, b"")``.

Meaning, for the engine's prefix cache (:class:`~kvpool.engine.block_pool.FixedBlockPool`,
which reports to a :class:`KVEventSink`): a hash is *stored* when the first cached block
with that hash appears and *removed* when the last one goes, whatever takes it away —
LRU eviction, a reclaim or a sleep of an elastic pool (kvpool taking KV back), a
handoff. So the set a subscriber rebuilds from the events is exactly the set of hashes
the engine can hit. The stream starts with ``AllBlocksCleared`` (sequence 0: a router
that reconnects to a restarted engine, or replays from 0, forgets what a killed
predecessor had cached) and a closing engine ends with one.

Never stalls the engine: the pool's calls only append to a bounded list
(``max_queue_size`` events); past it the pending events are dropped, counted
(:attr:`KVEventCollector.dropped`), and replaced by one ``AllBlocksCleared`` (a router
that forgets is safe; one that remembers KV that is gone is not). A background thread
encodes and sends; PUB never blocks on a slow subscriber (ZeroMQ drops at ``hwm``).

Configured as vLLM configures it: ``kvpool serve --kv-events-config JSON`` with vLLM's
keys (:class:`KVEventsConfig`)."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import msgspec

MEDIUM = "GPU"  # vLLM's medium for device KV (its MEDIUM_GPU), whatever the device
END_SEQ = (-1).to_bytes(8, "big", signed=True)
FLUSH_S = 0.05  # how often the publisher thread sends what the pool reported


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class KVEventsConfigError(ValueError):
    """A ``--kv-events-config`` that is not vLLM's shape (one line)."""


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``KVEventsConfig`` keys and defaults; ``publisher`` defaults to ``zmq``
    when events are enabled, ``null`` otherwise (as vLLM does)."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The JSON of ``--kv-events-config``; :class:`KVEventsConfigError` otherwise."""
        if len(text) > 4096:
            raise KVEventsConfigError("--kv-events-config: longer than 4096 characters")
        try:
            config = msgspec.json.decode(text.encode(), type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise KVEventsConfigError(f"--kv-events-config: {e}") from None
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if not 1 <= getattr(config, key) <= 10_000_000:
                raise KVEventsConfigError(
                    f"--kv-events-config: {key} must be in 1..10000000")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(config, key)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise KVEventsConfigError(
                    f"--kv-events-config: {key} {value!r} is not a tcp://, ipc:// or "
                    "inproc:// address")
        return config

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def dumps(self) -> str:
        return json.dumps(msgspec.to_builtins(self))


class KVEventSink(Protocol):
    """What a block pool reports its prefix cache's changes to.

    Obligations: the pool calls these with its own lock held, in the order the changes
    happen, with the engine's chained block hashes (signed 64-bit ints); the sink never
    blocks and never calls back into the pool."""

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int],
               block_size: int) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class KVEventCollector:
    """A :class:`KVEventSink` that keeps at most ``max_events`` pending events for the
    publisher to :meth:`take` (thread-safe; see the module for the overflow rule)."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self.dropped = 0  # events dropped on overflow, since start
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = []
        self._wake = threading.Event()

    def _add(self, event: KVEvent) -> None:
        with self._lock:
            if len(self._pending) >= self.max_events:
                self.dropped += len(self._pending) + 1
                self._pending = [AllBlocksCleared()]
            elif (isinstance(event, BlockRemoved) and self._pending
                  and isinstance(self._pending[-1], BlockRemoved)):
                self._pending[-1].block_hashes.extend(event.block_hashes)  # one eviction
            else:
                self._pending.append(event)
        self._wake.set()

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int],
               block_size: int) -> None:
        self._add(BlockStored(list(hashes), parent, list(tokens), block_size, None,
                              MEDIUM, None))

    def removed(self, hashes: Sequence[int]) -> None:
        self._add(BlockRemoved(list(hashes), MEDIUM))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        with self._lock:
            out, self._pending = self._pending, []
            self._wake.clear()
        return out

    def wait(self, timeout: float) -> None:
        self._wake.wait(timeout)


class ZmqKVEventPublisher:
    """The PUB (and replay ROUTER) sockets and the thread that sends the collector's
    events as batches, one per :data:`FLUSH_S` at most. The first batch (sequence 0) is
    ``AllBlocksCleared``; :meth:`close` sends what is pending, then ``AllBlocksCleared``,
    and stops."""

    def __init__(self, config: KVEventsConfig, collector: KVEventCollector,
                 data_parallel_rank: int | None = None) -> None:
        import zmq

        self.config = config
        self.collector = collector
        self.rank = data_parallel_rank
        self.sent = 0  # batches
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: Any = zmq.Context.instance()
        self._pub: Any = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: Any = None
        try:
            if "*" in config.endpoint or config.endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise KVEventsConfigError(f"--kv-events-config: cannot open "
                                      f"{config.endpoint}: {e}") from None
        self._send([AllBlocksCleared()])  # whatever an engine before this one had is gone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """Where the PUB socket is (the bound address when the config said port 0)."""
        return str(self._pub.getsockopt_string(_last_endpoint()))

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(_last_endpoint()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.collector.wait(FLUSH_S)
            self._serve_replay()
            self._flush()
            self._stop.wait(FLUSH_S)
        self._serve_replay()

    def _flush(self) -> None:
        events = self.collector.take()
        if events:
            self._send(events)

    def _send(self, events: list[KVEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self.rank))
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:  # noqa: BLE001 (a send that fails loses one batch, never the engine)
            pass
        self._buffer.append((seq, payload))
        self.sent += 1

    def _serve_replay(self) -> None:
        import zmq

        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: ignored (a hostile peer gets nothing)
            client, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        self._replay.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                            flags=zmq.NOBLOCK)
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""),
                                            flags=zmq.NOBLOCK)
            except zmq.Again:
                continue  # that client reads too slowly: it asks again

    def close(self) -> None:
        """Send what is pending and ``AllBlocksCleared``; stop. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._send([*self.collector.take(), AllBlocksCleared()])
        time.sleep(FLUSH_S)  # let ZeroMQ hand the last frames to the wire (linger below)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)


def _last_endpoint() -> int:
    import zmq

    return int(zmq.LAST_ENDPOINT)
