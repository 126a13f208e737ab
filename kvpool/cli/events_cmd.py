"""``kvpool events``: the daemon's decisions and memory moves (grant, release, wait,
deny, ask, answer, reclaim round, lease, sleep, wake, weight sets, limit change, tenant
death) from its ring buffer, and with ``--follow`` as they happen (a long poll: the
daemon answers as soon as there is something new). A gap (events the ring no longer
held) is printed as such, never hidden. The daemon keeps one log for every device it
serves (one ``seq`` order); on a daemon of several each line names its device, and
``--device`` keeps one device's."""

from __future__ import annotations

import contextlib
import datetime
import json
from typing import TYPE_CHECKING

import click

from kvpool.cli.monitor import chosen_device, monitor_session, served
from kvpool.cli.params import device_option, json_option, run_dir_option
from kvpool.sizes import format_size

if TYPE_CHECKING:
    from kvpool import protocol as p
    from kvpool.client_lib.admin import Monitor

POLL_MS = 10_000  # a follow request the daemon leaves unanswered this long is sent again


def fetch(mon: Monitor, since: int, tenant: str | None, follow: bool) -> p.EventsReply | None:
    """One Events call; None when a follow poll timed out with nothing new."""
    from kvpool import protocol as p
    from kvpool.client_lib.errors import DaemonUnavailable

    req = p.Events(since=since, tenant=tenant, follow=follow)
    try:
        return mon.conn.call(req, p.EventsReply, timeout_ms=POLL_MS if follow else None)[0]
    except DaemonUnavailable as e:
        if follow and e.code == p.BUSY and not mon.conn.daemon_gone:
            return None
        raise


def _sizes(by_name: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_size(v)}" for k, v in sorted(by_name.items()))


def describe(ev: p.EventInfo, brief: bool = False, device: bool = False) -> str:
    """One event as a line of text (``brief``: without messages and timings; ``device``:
    naming its device)."""
    d = dict(ev.detail)
    if brief:
        for key in ("message", "service_s", "group", "units", "seq", "urgent"):
            d.pop(key, None)
    when = datetime.datetime.fromtimestamp(ev.time).strftime("%H:%M:%S.%f")[:-3]
    where = f" dev {ev.device}" if device else ""
    who = ev.tenant or "-"
    size = format_size(ev.bytes) if ev.bytes else ""
    if ev.kind == "reclaim":
        text = (f"round of {d.get('duration_s', 0) * 1000:.1f} ms granted {size}: asked "
                f"[{_sizes(d.get('asked', {})) or 'nobody'}], answered "
                f"[{_sizes(d.get('answered', {})) or 'nothing'}]")
        if d.get("slept"):
            text += f", put to sleep [{_sizes(d['slept'])}]"
        if d.get("evicted"):
            text += f", {format_size(d['evicted'])} of cached weight sets evicted"
        text += f", {format_size(d.get('free_at_start', 0))} free at start"
        return f"{when} {ev.seq:>7}{where} reclaim  {text}"
    extra = " ".join(f"{k}={v}" for k, v in d.items() if k != "tenants")
    return f"{when} {ev.seq:>7}{where} {ev.kind:<8} {who:<16} {size:>10} {extra}".rstrip()


@click.command()
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events (Ctrl-C ends).")
@click.option("--tenant", default=None, help="Only events naming this tenant (name or id).")
@click.option("--since", type=click.IntRange(min=0), default=0,
              help="Only events after this sequence number.")
@run_dir_option
@device_option
@json_option
def events(follow: bool, tenant: str | None, since: int, run_dir: str | None,
           as_json: bool) -> None:
    """Show the daemon's recent decisions and memory moves; with --follow, as they
    happen. A daemon serving several devices: every device's (each line names it), or
    --device's."""
    from kvpool import protocol as p

    device = chosen_device()
    with monitor_session(run_dir) as mon, contextlib.suppress(KeyboardInterrupt):
        several = len(served(mon)) > 1
        while True:
            reply = fetch(mon, since, tenant, follow)
            if reply is None:
                continue
            if reply.lost:
                click.echo(json.dumps({"kind": "gap", "lost": reply.lost}) if as_json else
                           f"... {reply.lost} events lost (the daemon's ring buffer moved on)")
            for ev in reply.events:
                if device is not None and ev.device != device:
                    continue
                click.echo(json.dumps(p.to_builtins(ev)) if as_json else
                           describe(ev, device=several))
            since = reply.next
            if not follow and len(reply.events) < p.EVENTS_LIMIT:
                return


def register(cli: click.Group) -> None:
    cli.add_command(events)
