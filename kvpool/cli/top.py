"""``kvpool top``: a live view of the daemon, refreshed about once a second.

One row per tenant: a bar of in use / reserve / lease against its limit with its fair
share marked, grant and reclaim-ask rates (from the event stream), a sparkline of its
mapped memory; then the pool lines and the last few events (grants and releases summed
per tenant: ``grant x12``). A daemon serving several devices: every device's tenants (a
DEV column) and pools, or ``--device``'s. ``q`` quits; ``--once`` prints one frame (no
terminal needed). Fits 80 columns (usable over ssh).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Literal

import click

from kvpool.cli.monitor import chosen_device, device_sessions
from kvpool.cli.params import device_option, run_dir_option
from kvpool.sizes import format_size

if TYPE_CHECKING:
    from rich.console import Group

    from kvpool import protocol as p
    from kvpool.client_lib.admin import Monitor

BAR = 18
SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 12
EVENT_LINES = 5
FREQUENT = ("grant", "release")  # summed per tenant in the last events


@dataclass
class View:
    """What top remembers between frames: history, event rates, the last events."""

    since: int = 0
    history: dict[str, deque[int]] = field(default_factory=dict)
    recent: deque[p.EventInfo] = field(default_factory=lambda: deque(maxlen=EVENT_LINES))
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (grants/s, asks/s)
    last: float = 0.0

    def update(self, mons: list[Monitor], device: int | None = None
               ) -> tuple[list[p.PsReply], list[p.EventInfo]]:
        """Fetch each device's ``ps`` and the events since the last frame (only
        ``device``'s when given); returns (ps replies, events)."""
        from kvpool import protocol as p

        replies = [m.ps() for m in mons]
        evs: list[p.EventInfo] = []
        for _ in range(10):  # at most 10 x EVENTS_LIMIT events per frame
            reply = mons[0].call(p.Events(since=self.since), p.EventsReply)  # (every device's)
            evs.extend(ev for ev in reply.events if device is None or ev.device == device)
            self.since = reply.next
            if len(reply.events) < p.EVENTS_LIMIT:
                break
        now = time.monotonic()
        span = max(1e-3, now - self.last) if self.last else None
        self.last = now
        grants: Counter[str] = Counter()
        asks: Counter[str] = Counter()
        for ev in evs:
            if ev.kind == "grant":
                grants[ev.tenant] += 1
            elif ev.kind == "ask":
                asks[ev.tenant] += 1
            self.remember(ev)
        for t in (t for r in replies for t in r.tenants):
            self.history.setdefault(t.name, deque(maxlen=HISTORY)).append(t.mapped)
            self.rates[t.name] = ((grants[t.name] / span, asks[t.name] / span)
                                  if span else (0.0, 0.0))
        return replies, evs

    def remember(self, ev: p.EventInfo) -> None:
        """Keep ``ev`` among the last events; a grant or release joins the one of its
        tenant already shown (summed: bytes, ``x`` count), so the frequent ones do not
        push the rest out."""
        from kvpool import protocol as p

        if ev.kind in FREQUENT:
            for old in self.recent:
                if old.kind == ev.kind and old.tenant_id == ev.tenant_id \
                        and old.device == ev.device:
                    self.recent.remove(old)
                    ev = p.EventInfo(seq=ev.seq, time=ev.time, kind=ev.kind, tenant=ev.tenant,
                                     tenant_id=ev.tenant_id, bytes=old.bytes + ev.bytes,
                                     device=ev.device,
                                     detail={"x": int(old.detail.get("x", 1)) + 1})
                    break
            else:
                ev = p.EventInfo(seq=ev.seq, time=ev.time, kind=ev.kind, tenant=ev.tenant,
                                 tenant_id=ev.tenant_id, bytes=ev.bytes, device=ev.device,
                                 detail={"x": 1})
        self.recent.append(ev)


def bar(t: p.TenantInfo, width: int = BAR) -> str:
    """In use ``█``, reserve ``▒``, lease ``▓``, free up to the limit ``·``; the fair
    share is marked ``|`` where it falls on free cells."""
    limit = max(t.max, t.mapped + t.lease, 1)
    cells: list[str] = []
    for glyph, nbytes in (("█", t.in_use), ("▒", t.reserve), ("▓", t.lease)):
        cells += [glyph] * round(width * min(nbytes, limit) / limit)
    cells = (cells + ["·"] * width)[:width]
    mark = min(width - 1, round(width * t.fair_share / limit)) if t.fair_share else None
    if mark is not None and cells[mark] == "·":
        cells[mark] = "|"
    return "".join(cells)


def sparkline(values: Iterable[int]) -> str:
    vals = list(values)
    top = max(vals) if vals else 0
    if not top:
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(len(SPARK) - 1, int(v * (len(SPARK) - 1) / top + 0.5))] for v in vals)


def frame(view: View, replies: list[p.PsReply], width: int = 80) -> Group:
    """One frame as a rich renderable: every device's tenants and pool in ``replies``."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from kvpool.cli.events_cmd import describe

    several = len(replies) > 1
    table = Table(box=None, padding=(0, 1), pad_edge=False, expand=False)
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("TENANT", "left"), *((("DEV", "right"),) if several else ()), ("MAPPED", "right"),
        ("USE▒RES▓LEASE|SHARE", "left"), ("LIMIT", "right"), ("STATE", "left"),
        ("GR/s", "right"), ("RC/s", "right"), ("HISTORY", "left"))
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=True)
    tenants = [t for r in replies for t in r.tenants]
    for t in tenants:
        g, r = view.rates.get(t.name, (0.0, 0.0))
        name = (t.name or "(unregistered)")[:14 - 4 * several]
        if t.unresponsive:
            name += "!"
        history = sparkline(view.history.get(t.name, ()))
        table.add_row(name, *((str(t.device),) if several else ()), format_size(t.mapped),
                      bar(t), format_size(t.max), t.state + ("*" if t.sleepable else ""),
                      f"{g:.0f}", f"{r:.0f}", history[-(HISTORY - 4 * several):])
    pools: list[Text] = []
    for ps in replies:
        pool = ps.pool
        assert pool is not None, "the daemon's ps reply always carries the pool"
        line = (f"pool {pool.backend}:{pool.device}  budget {format_size(pool.budget)}  "
                f"granted {format_size(pool.granted)}  leased {format_size(pool.leased)}  "
                f"free {format_size(pool.free)}")
        line2 = f"     warm {format_size(pool.warm)}  dirty {format_size(pool.dirty)}"
        if pool.waiting:
            line2 += f"  waiting {format_size(pool.waiting)}"
        pools += [Text(line[: width - 1], no_wrap=True), Text(line2[: width - 1], no_wrap=True)]
    events = [Text(describe(ev, brief=True, device=several)[: width - 1], no_wrap=True,
                   overflow="crop") for ev in view.recent] or [Text("(no events yet)")]
    where = f" — {len(replies)} devices" if several else ""
    head = Text(f"kvpool top — {len(tenants)} tenants{where} — {time.strftime('%H:%M:%S')}"
                f"   (q quits)", style="bold")
    return Group(head, table, *pools, Text("last events:"), *events)


@contextlib.contextmanager
def cbreak(fd: int) -> Iterator[bool]:
    """Keys without Enter (restored on exit); a no-op when stdin is no terminal."""
    if not os.isatty(fd):
        yield False
        return
    import termios
    import tty

    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def quit_pressed(fd: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a key; True when it is ``q``."""
    poller = select.poll()  # poll, not a 1024-bounded fd set
    poller.register(fd, select.POLLIN)
    if not poller.poll(timeout_s * 1000):
        return False
    data = os.read(fd, 32)
    return not data or b"q" in data.lower()


@click.command()
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--interval", type=click.FloatRange(0.1, 60), default=1.0,
              help="Seconds between frames.")
@run_dir_option
@device_option
def top(once: bool, interval: float, run_dir: str | None) -> None:
    """A live view of tenants, the pool and recent events (q quits)."""
    from rich.console import Console
    from rich.live import Live

    view = View()
    device = chosen_device()
    with device_sessions(run_dir) as mons, contextlib.suppress(KeyboardInterrupt):
        if once:
            view.update(mons, device)  # a first sample, then the rates over a short span
            time.sleep(min(interval, 0.5))
            ps, _ = view.update(mons, device)
            console = Console(width=80 if not sys.stdout.isatty() else None)
            console.print(frame(view, ps, console.width))
            return
        console = Console()
        fd = sys.stdin.fileno()
        with cbreak(fd) as keys, Live(console=console, auto_refresh=False,
                                      screen=console.is_terminal) as live:
            while True:
                ps, _ = view.update(mons, device)
                live.update(frame(view, ps, console.width), refresh=True)
                if keys and quit_pressed(fd, interval):
                    return
                if not keys:
                    time.sleep(interval)


def register(cli: click.Group) -> None:
    cli.add_command(top)
