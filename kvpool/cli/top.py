"""``kvpool top``: a live view of the daemon, refreshed about once a second.

One row per tenant: a bar of in use / reserve / lease against its limit with its fair
share marked, grant and reclaim-ask rates (from the event stream), a sparkline of its
mapped memory; then the pool line and the last few events. ``q`` quits; ``--once``
prints one frame (no terminal needed). Fits 80 columns (usable over ssh).
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

from kvpool.cli.monitor import monitor_session
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


@dataclass
class View:
    """What top remembers between frames: history, event rates, the last events."""

    since: int = 0
    history: dict[str, deque[int]] = field(default_factory=dict)
    recent: deque[p.EventInfo] = field(default_factory=lambda: deque(maxlen=EVENT_LINES))
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (grants/s, asks/s)
    last: float = 0.0

    def update(self, mon: Monitor) -> tuple[p.PsReply, list[p.EventInfo]]:
        """Fetch ``ps`` and the events since the last frame; returns (ps reply, events)."""
        from kvpool import protocol as p

        ps = mon.ps()
        evs: list[p.EventInfo] = []
        for _ in range(10):  # at most 10 x EVENTS_LIMIT events per frame
            reply = mon.call(p.Events(since=self.since), p.EventsReply)
            evs.extend(reply.events)
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
            if ev.kind not in ("grant",):  # grants are counted, the rest is shown
                self.recent.append(ev)
        for t in ps.tenants:
            self.history.setdefault(t.name, deque(maxlen=HISTORY)).append(t.mapped)
            self.rates[t.name] = ((grants[t.name] / span, asks[t.name] / span)
                                  if span else (0.0, 0.0))
        return ps, evs


def bar(t: p.TenantInfo, width: int = BAR) -> str:
    """In use ``█``, reserve ``▒``, lease ``▓``, free up to the limit ``·``; the fair
    share is marked ``|`` where it falls on free cells."""
    limit = max(t.max, t.mapped + t.lease, 1)
    cells: list[str] = []
    for glyph, nbytes in (("█", t.in_use), ("▒", t.reserve), ("▓", t.lease)):
        cells += [glyph] * round(width * min(nbytes, limit) / limit)
    cells = (cells + ["·"] * width)[:width]
    mark = min(width - 1, round(width * t.share / limit)) if t.share else None
    if mark is not None and cells[mark] == "·":
        cells[mark] = "|"
    return "".join(cells)


def sparkline(values: Iterable[int]) -> str:
    vals = list(values)
    top = max(vals) if vals else 0
    if not top:
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(len(SPARK) - 1, int(v * (len(SPARK) - 1) / top + 0.5))] for v in vals)


def frame(view: View, ps: p.PsReply, width: int = 80) -> Group:
    """One frame as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from kvpool.cli.events_cmd import describe

    table = Table(box=None, padding=(0, 1), pad_edge=False, expand=False)
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("TENANT", "left"), ("MAPPED", "right"), ("USE▒RES▓LEASE|SHARE", "left"),
        ("LIMIT", "right"), ("STATE", "left"), ("GR/s", "right"), ("RC/s", "right"),
        ("HISTORY", "left"))
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=True)
    for t in ps.tenants:
        g, r = view.rates.get(t.name, (0.0, 0.0))
        name = (t.name or "(unregistered)")[:14]
        if t.unresponsive:
            name += "!"
        table.add_row(name, format_size(t.mapped), bar(t), format_size(t.max),
                      t.state + ("*" if t.sleepable else ""), f"{g:.0f}", f"{r:.0f}", sparkline(view.history.get(t.name, ())))
    pool = ps.pool
    assert pool is not None, "the daemon's ps reply always carries the pool"
    line = (f"pool {pool.backend}:{pool.device}  budget {format_size(pool.budget)}  granted "
            f"{format_size(pool.granted)}  leased {format_size(pool.leased)}  free "
            f"{format_size(pool.free)}")
    line2 = f"     warm {format_size(pool.warm)}  dirty {format_size(pool.dirty)}"
    if pool.waiting:
        line2 += f"  waiting {format_size(pool.waiting)}"
    events = [Text(describe(ev, brief=True)[: width - 1], no_wrap=True, overflow="crop")
              for ev in view.recent] or [Text("(no events yet)")]
    head = Text(f"kvpool top — {len(ps.tenants)} tenants — {time.strftime('%H:%M:%S')}"
                f"   (q quits)", style="bold")
    return Group(head, table, Text(line[: width - 1], no_wrap=True),
                 Text(line2[: width - 1], no_wrap=True), Text("last events:"),
                 *events)


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
    with monitor_session(run_dir) as mon, contextlib.suppress(KeyboardInterrupt):
        if once:
            view.update(mon)  # a first sample, then the rates over a short span
            time.sleep(min(interval, 0.5))
            ps, _ = view.update(mon)
            console = Console(width=80 if not sys.stdout.isatty() else None)
            console.print(frame(view, ps, console.width))
            return
        console = Console()
        fd = sys.stdin.fileno()
        with cbreak(fd) as keys, Live(console=console, auto_refresh=False,
                                      screen=console.is_terminal) as live:
            while True:
                ps, _ = view.update(mon)
                live.update(frame(view, ps, console.width), refresh=True)
                if keys and quit_pressed(fd, interval):
                    return
                if not keys:
                    time.sleep(interval)


def register(cli: click.Group) -> None:
    cli.add_command(top)
