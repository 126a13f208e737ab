"""A tenant process for the daemon tests. Prints one JSON object per line on stdout.

Modes:
  churn  — an ElasticBlockAllocator under random alloc/free for ``--seconds``; every
           held block carries a tag (checked on free, so data survives reserve churn).
  hold   — grant ``--units`` units, fill them with ``--fill``, say ready, sleep forever.
"""

from __future__ import annotations

import ctypes
import random
import time
from pathlib import Path

from worker_cli import emit, parser, run, sleep_forever  # (run as a script only)


def churn(args) -> None:
    from kvpool.client_lib import ElasticBlockAllocator, OverLimit, connect

    rng = random.Random(args.seed)
    with connect(name=args.name, run_dir=args.run_dir) as t:
        g = t.region_group(args.regions, args.capacity)
        a = ElasticBlockAllocator(g, args.block, low=args.low, high=args.high, tick_s=0.002)
        emit(event="ready", pid=__import__("os").getpid(), group=g.id)
        held: dict[int, int] = {}
        ok = none = frees = over_limit = 0
        deadline = time.monotonic() + args.seconds
        probe_done = False
        stop_file = Path(args.until_file) if args.until_file else None
        while time.monotonic() < deadline and not (stop_file and stop_file.exists()):
            if args.pace_ms:
                time.sleep(args.pace_ms / 1000)
            if held and (len(held) >= args.max_blocks or rng.random() < 0.45):
                victims = rng.sample(list(held), min(len(held), rng.randint(1, 8)))
                for b in victims:
                    for r in range(args.regions):
                        addr = g.ranges[r].base + a.block_offset(b)
                        got = ctypes.c_uint64.from_address(addr).value
                        if got != held[b]:
                            raise AssertionError(f"block {b} region {r}: {got:#x} != {held[b]:#x}")
                a.free(victims)
                for b in victims:
                    del held[b]
                frees += 1
            else:
                n = rng.randint(1, 8)
                blocks = a.alloc(n)
                if blocks is None:
                    none += 1
                    time.sleep(0.001)
                    continue
                ok += 1
                for b in blocks:
                    tag = rng.getrandbits(63) | 1
                    held[b] = tag
                    for r in range(args.regions):
                        ctypes.c_uint64.from_address(g.ranges[r].base + a.block_offset(b)).value = tag
            due = ok >= args.mark_ok if args.mark_ok else \
                time.monotonic() > deadline - args.seconds / 2
            if not probe_done and due and (args.mark_ok or args.probe_over_limit):
                probe_done = True
                if args.probe_over_limit:
                    g2 = t.region_group(1, t.limit + t.page_size)
                    try:
                        g2.grant(range(t.limit // t.page_size + 1))
                    except OverLimit:
                        over_limit += 1
                        emit(event="over_limit")
                    g2.close()
                if args.mark_ok:  # (after the probe: a reader may stop it now)
                    emit(event="ok_reached", ok=ok)
        a.check_integrity()
        emit(event="done", ok=ok, none=none, frees=frees, over_limit=over_limit,
             slow=a.slow_allocs, grants=a.grants, releases=a.releases, held=len(held))
        a.free(list(held))


def hold(args) -> None:
    from kvpool.client_lib import connect

    t = connect(name=args.name, run_dir=args.run_dir)
    g = t.region_group(args.regions, args.capacity)
    g.grant(range(args.units))
    size = args.units * t.page_size
    for r in g.ranges:
        ctypes.memset(r.base, args.fill, size)
    emit(event="ready", pid=__import__("os").getpid(), pages=args.units * args.regions)
    sleep_forever()


def main() -> None:
    ap = parser(["churn", "hold"], name="worker", capacity=4 << 20)
    ap.add_argument("--block", type=int, default=16 << 10)
    ap.add_argument("--low", type=int, default=1)
    ap.add_argument("--high", type=int, default=4)
    ap.add_argument("--max-blocks", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-over-limit", action="store_true")
    ap.add_argument("--mark-ok", type=int, default=0,
                    help="churn: after this many allocations emit ok_reached and probe "
                         "(--probe-over-limit) then, not halfway through --seconds")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="churn: sleep per step")
    ap.add_argument("--until-file", default=None, help="churn: stop early once this exists")
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--fill", type=lambda s: int(s, 0), default=0xAB)
    run(ap, {"churn": churn, "hold": hold})


if __name__ == "__main__":
    main()
