"""A tenant process for the handoff tests. Prints one JSON object per line on stdout.

Modes:
  give — grant ``--units`` units of a ``--regions`` group, fill unit ``u`` of region ``r``
         with :func:`pattern`, offer ``--offer`` of them to ``--to``, print the ticket;
         with ``--touch-after`` wait for the ticket to settle, print it, read a kept
         unit (fine) and then a unit it gave away (the process dies by SIGSEGV);
         otherwise wait forever.
  take — read a ticket id from stdin, claim it at ``--at`` of a fresh group, check the
         bytes against :func:`pattern` of ``--from-units``, print, wait forever.
"""

from __future__ import annotations

import ctypes
import sys

if __package__:  # imported by the tests
    from .worker_cli import emit, parser, run, sleep_forever
else:  # run as a script
    from worker_cli import emit, parser, run, sleep_forever


def pattern(unit: int, region: int, size: int) -> bytes:
    """What the giver writes in unit ``unit`` of region ``region`` (distinct per page)."""
    head = f"unit {unit} region {region} ".encode()
    return (head * (size // len(head) + 1))[:size]


def fill(group, units) -> None:
    ps = group.page_size
    for u in units:
        for r in range(group.n_regions):
            data = pattern(u, r, ps)
            ctypes.memmove(group.unit_address(r, u), data, ps)


def read(group, unit: int, region: int = 0) -> bytes:
    return ctypes.string_at(group.unit_address(region, unit), group.page_size)


def give(args) -> None:
    from kvpool.client_lib import connect
    from kvpool.client_lib import handoff

    t = connect(name=args.name, run_dir=args.run_dir)
    g = t.region_group(args.regions, args.capacity)
    g.grant(range(args.units))
    fill(g, range(args.units))
    offered = [int(x) for x in args.offer.split(",")]
    ticket = handoff.offer(g, offered, to=args.to, ttl_s=args.ttl)
    emit(event="ticket", ticket=ticket.id, pid=__import__("os").getpid(), group=g.id)
    if not args.touch_after:
        sleep_forever()
    state = ticket.wait(60)
    kept = sorted(set(range(args.units)) - set(offered))
    emit(event="settled", state=state, mapped=sorted(g.mapped))
    if kept:
        ok = read(g, kept[0]) == pattern(kept[0], 0, g.page_size)
        emit(event="kept", unit=kept[0], ok=ok)
    emit(event="touching", unit=offered[0])
    read(g, offered[0])  # unmapped now: SIGSEGV
    emit(event="survived")


def take(args) -> None:
    from kvpool.client_lib import connect
    from kvpool.client_lib import handoff

    t = connect(name=args.name, run_dir=args.run_dir)
    g = t.region_group(args.regions, args.capacity)
    emit(event="ready", pid=__import__("os").getpid())
    tid = sys.stdin.readline().strip()
    at = [int(x) for x in args.at.split(",")]
    handoff.claim(g, tid, at)
    src = [int(x) for x in args.from_units.split(",")]
    ok = all(read(g, a, r) == pattern(s, r, g.page_size)
             for a, s in zip(at, src) for r in range(g.n_regions))
    emit(event="claimed", ok=ok, mapped=sorted(g.mapped))
    sleep_forever()


def main() -> None:
    ap = parser(["give", "take"], name="prefill", capacity=8 << 16)
    ap.add_argument("--units", type=int, default=3)
    ap.add_argument("--offer", default="1,2")
    ap.add_argument("--to", default="decode")
    ap.add_argument("--ttl", type=float, default=30.0)
    ap.add_argument("--touch-after", action="store_true")
    ap.add_argument("--at", default="0,1")
    ap.add_argument("--from-units", default="1,2")
    run(ap, {"give": give, "take": take})


if __name__ == "__main__":
    main()
