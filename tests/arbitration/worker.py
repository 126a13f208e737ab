"""A tenant process for the arbitration tests. Prints one JSON object per line on stdout.

Modes:
  contend — wants every block it can get: "requests" of one or two blocks whose blocks
            become prefix cache when they end, and now and then it evicts some cache.
  idle    — fills a prefix cache of ``--blocks`` blocks, says ready, then its main thread
            sleeps.
  hold    — allocates ``--blocks`` blocks with no shrink callback, then keeps reading and
            writing them (a pattern per block) and reports progress; survives daemon
            restarts.

contend and idle are tenants the way an engine is one: their blocks live in the bundled
engine's own elastic block pool (``BundledElasticPool`` over the client library's
``ElasticBlockAllocator``), and the pool's shrink (the adapter's ``ElasticPolicy``: whole
chunks of cache fewest held first, then all of it) is the tenant's shrink callback, as
``kvpool serve --elastic`` wires it. No shrink logic of the test's own.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import threading
import time
import traceback
from pathlib import Path


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


class Cache:
    """Held blocks (hold mode: nothing reclaims them, there is no shrink callback)."""

    def __init__(self, alloc):
        self.a = alloc
        self.lock = threading.Lock()
        self.held: set[int] = set()

    def add(self, n: int) -> bool:
        got = self.a.alloc(n)  # not under the lock: the slow path may wait for reclaim
        if got is None:
            return False
        with self.lock:
            self.held.update(got)
        return True


class EngineCache:
    """A prefix cache in the bundled engine's elastic pool (the project's own shrink).

    Every "step" runs under the pool's ``step_lock``, as an engine's does (the policy's
    shrink takes it first, so it evicts between steps). A request takes blocks
    (``get_new_blocks``: the allocator's reserve, then the pool's own cache, else demand
    its thread asks the daemon for), caches them as one hash chain and frees them: they
    stay mapped as evictable cache until the pool's own allocation, or the daemon's
    reclaim, evicts them. ``wants_more``: each request first waits for its blocks from
    the daemon (the allocator's slow path), as an engine under load that wants more than
    its share does, instead of reusing its own cache."""

    def __init__(self, t, args, wants_more: bool = False):
        from kvpool.client_lib import ElasticBlockAllocator
        from kvpool.engine_adapters.bundled.block_pool import BundledElasticPool

        self.group = t.region_group(args.regions, args.capacity)
        self.pool = BundledElasticPool(1)
        self.pool.bind(ElasticBlockAllocator(
            self.group, args.block, low=args.low, high=args.high,
            idle_timeout_s=args.idle_timeout, tick_s=0.005, take_first=1))
        t.set_shrink_callback(self.pool.shrink)
        self.requests = 0
        self.wants_more = wants_more

    def request(self, n: int) -> bool:
        """One request of ``n`` blocks that ends at once; False when the pool has no
        memory for it now (the allocator's thread asks the daemon meanwhile)."""
        from kvpool.engine.block_pool import NULL_BLOCK
        from kvpool.engine.errors import PoolExhausted

        if self.wants_more:
            # the library's slow path: asks the daemon and waits while it reclaims from
            # tenants above their share; the blocks go back to the reserve the step takes
            got = self.pool.allocator.alloc(n)
            if got is None:
                return False
            self.pool.allocator.free(got)
        with self.pool.step_lock:
            try:
                blocks = self.pool.get_new_blocks(n)
            except PoolExhausted:
                return False
            self.requests += 1
            hashes = [hash((os.getpid(), self.requests, k)) for k in range(n)]
            self.pool.cache_full_blocks(blocks, hashes, [(self.requests, k) for k in range(n)],
                                        NULL_BLOCK)
            self.pool.free_blocks(blocks)
        return True

    def evict(self, n: int) -> None:
        with self.pool.step_lock:
            self.pool.evict_cached_blocks(n)

    def fill(self, n: int, timeout_s: float = 60.0) -> None:
        """Cache ``n`` blocks, one request each (waits for the allocator's grants)."""
        deadline = time.monotonic() + timeout_s
        while self.pool.num_cached_blocks < n:
            if not self.request(1):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.pool.num_cached_blocks} of {n} blocks cached")
                time.sleep(0.005)  # the allocator's thread is asking the daemon

    def done(self) -> dict:
        with self.pool.step_lock:
            self.pool.check_integrity()
        pol = self.pool.policy
        return {"shrinks": pol.shrinks, "evictions": pol.shrink_evictions,
                "held": self.pool.num_cached_blocks}


def connect(args):
    from kvpool.client_lib import connect as kv_connect

    kw = {}
    if args.shares is not None:
        kw["shares"] = args.shares
    if args.min is not None:
        kw["min"] = args.min
    return kv_connect(name=args.name, run_dir=args.run_dir, **kw)


def allocator(t, args):
    from kvpool.client_lib import ElasticBlockAllocator

    g = t.region_group(args.regions, args.capacity)
    a = ElasticBlockAllocator(g, args.block, low=args.low, high=args.high,
                              idle_timeout_s=args.idle_timeout, tick_s=0.005)
    return g, a


def settle(a) -> None:
    """Refill/trim steps until one changes nothing (the reserve is within its marks: the
    background thread has nothing left to do while no block is taken), then report."""
    while True:
        before = a.holdings().mapped
        a.rebalance()
        if a.holdings().mapped == before:
            break
    a.report()


def contend(args) -> None:
    import kvpool.engine_adapters.bundled.block_pool  # noqa: F401  (torch: before connect)

    rng = random.Random(args.seed)
    t = connect(args)
    cache = EngineCache(t, args, wants_more=True)
    emit(event="ready", pid=os.getpid())
    stop = Path(args.until_file) if args.until_file else None
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline and not (stop and stop.exists()):
        if cache.pool.num_cached_blocks and rng.random() < 0.25:
            cache.evict(rng.randint(1, 2))
        elif not cache.request(rng.randint(1, 2)):
            time.sleep(0.005)
        time.sleep(0.001)
    emit(event="done", reclaims=t.reclaims, **cache.done())
    t.close()


def idle(args) -> None:
    if args.mode == "idle":
        import kvpool.engine_adapters.bundled.block_pool  # noqa: F401  (torch)
    t = connect(args)
    if args.mode == "idle":
        cache = EngineCache(t, args)
        cache.fill(args.blocks)
        emit(event="ready", pid=os.getpid(), blocks=cache.pool.num_cached_blocks,
             mapped=cache.pool.allocator.holdings().mapped)
        while True:
            time.sleep(1)
    g, a = allocator(t, args)
    held = Cache(a)
    if not held.add(args.blocks):  # not inside an assert: python -O would skip the work
        raise RuntimeError("initial allocation failed")
    settle(a)  # the reserve settles before ready (a test compares ps across restarts)
    emit(event="ready", pid=os.getpid(), blocks=len(held.held),
         mapped=a.holdings().mapped)
    # hold: write a pattern per block, keep verifying and rewriting it
    base = g.ranges[0].base
    gen = 1
    rounds = 0
    last = time.monotonic()
    while True:
        for b in sorted(held.held):
            addr = base + a.block_offset(b)
            if gen > 1:
                got = ctypes.c_uint64.from_address(addr).value
                want = (b << 32) | (gen - 1)
                if got != want:
                    raise AssertionError(f"block {b}: {got:#x} != {want:#x}")
            ctypes.c_uint64.from_address(addr).value = (b << 32) | gen
        gen += 1
        rounds += 1
        if time.monotonic() - last > 0.1:
            last = time.monotonic()
            emit(event="alive", rounds=rounds, connected=t.connected, reconnects=t.reconnects)
        time.sleep(0.005)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["contend", "idle", "hold"])
    ap.add_argument("--name", default="worker")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--regions", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=8 << 20)
    ap.add_argument("--block", type=int, default=64 << 10)
    ap.add_argument("--low", type=int, default=1)
    ap.add_argument("--high", type=int, default=2)
    ap.add_argument("--idle-timeout", type=float, default=30.0)
    ap.add_argument("--shares", type=float, default=None)
    ap.add_argument("--min", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--until-file", default=None)
    args = ap.parse_args()
    try:
        {"contend": contend, "idle": idle, "hold": idle}[args.mode](args)
    except Exception as e:
        emit(event="error", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        sys.exit(1)


if __name__ == "__main__":
    main()
