"""A tenant process for the arbitration tests. Prints one JSON object per line on stdout.

Modes:
  contend — wants every block it can get: allocates one or two blocks at a time and now
            and then frees some; its shrink callback evicts whole chunks (fewest held
            blocks first) like an engine dropping cached prefix blocks.
  idle    — allocates ``--blocks`` blocks it keeps as "cache", says ready, then its main
            thread sleeps; the shrink callback evicts cache (the library does the rest).
  hold    — like ``idle`` without a shrink callback, then keeps reading and writing its
            blocks (a pattern per block) and reports progress; survives daemon restarts.
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
    """Held blocks, evictable by the shrink callback (thread-safe)."""

    def __init__(self, alloc):
        self.a = alloc
        self.lock = threading.Lock()
        self.held: set[int] = set()
        self.evictions = 0

    def add(self, n: int) -> bool:
        got = self.a.alloc(n)  # not under the lock: the slow path may wait for reclaim
        if got is None:
            return False
        with self.lock:
            self.held.update(got)
        return True

    def drop(self, rng: random.Random, n: int) -> None:
        with self.lock:
            victims = rng.sample(sorted(self.held), min(n, len(self.held)))
            self.a.free(victims)
            self.held.difference_update(victims)

    def shrink(self, nbytes: int, urgent: bool) -> None:
        with self.lock:
            self.evictions += 1
            per_chunk = self.a.holdings().chunk
            by_chunk: dict[int, list[int]] = {}
            for b in self.held:
                by_chunk.setdefault(self.a.chunk_of(b), []).append(b)
            freed = 0
            for c in sorted(by_chunk, key=lambda c: len(by_chunk[c])):
                if freed >= nbytes:
                    break
                self.a.free(by_chunk[c])
                self.held.difference_update(by_chunk[c])
                freed += per_chunk


def connect(args):
    from kvpool.client_lib import connect as kv_connect

    kw = {}
    if args.weight is not None:
        kw["weight"] = args.weight
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
    rng = random.Random(args.seed)
    t = connect(args)
    g, a = allocator(t, args)
    cache = Cache(a)
    t.set_shrink_callback(cache.shrink)
    emit(event="ready", pid=os.getpid())
    stop = Path(args.until_file) if args.until_file else None
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline and not (stop and stop.exists()):
        if cache.held and rng.random() < 0.25:
            cache.drop(rng, rng.randint(1, 2))
        elif not cache.add(rng.randint(1, 2)):
            time.sleep(0.005)
        time.sleep(0.001)
    a.check_integrity()
    emit(event="done", evictions=cache.evictions, reclaims=t.reclaims, held=len(cache.held))
    t.close()


def idle(args) -> None:
    t = connect(args)
    g, a = allocator(t, args)
    cache = Cache(a)
    if not cache.add(args.blocks):  # not inside an assert: python -O would skip the work
        raise RuntimeError("initial allocation failed")
    if args.mode == "idle":
        t.set_shrink_callback(cache.shrink)
    else:  # hold: the reserve settles before ready (a test compares ps across restarts)
        settle(a)
    emit(event="ready", pid=os.getpid(), blocks=len(cache.held),
         mapped=a.holdings().mapped)
    if args.mode == "idle":
        while True:
            time.sleep(1)
    # hold: write a pattern per block, keep verifying and rewriting it
    base = g.ranges[0].base
    gen = 1
    rounds = 0
    last = time.monotonic()
    while True:
        for b in sorted(cache.held):
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
    ap.add_argument("--weight", type=float, default=None)
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
