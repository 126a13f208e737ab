"""``kvpool sleep NAME`` and ``kvpool wake NAME``: ask a serving tenant to sleep (release
all its KV and its weight-set holds) or to wake, then wait until ``ps`` shows it so.

Allowed for the tenant's own uid and for admin identities (the daemon decides:
:mod:`kvpool.daemon.sleepers`). One line and a nonzero exit when no tenant of that name is
connected, when the daemon refuses, or when ``--wait`` expires first.
"""

from __future__ import annotations

import time

import click

from kvpool.cli.monitor import monitor_session
from kvpool.cli.params import run_dir_option

POLL_S = 0.05


def _ask(name: str, wake: bool, wait_s: float, run_dir: str | None) -> None:
    verb = "wake" if wake else "sleep"
    with monitor_session(run_dir) as mon:
        asked = mon.sleep(name, wake=wake)
        if not asked:
            raise click.ClickException(f"no tenant named {name} is connected")

        def done() -> bool:
            states = [t.state for t in mon.ps().tenants if t.name == name]
            return bool(states) and all((s != "asleep") if wake else (s == "asleep")
                                        for s in states)

        deadline = time.monotonic() + wait_s
        while not done():
            if time.monotonic() >= deadline:
                raise click.ClickException(
                    f"{name} was asked to {verb} but is not {'awake' if wake else 'asleep'} "
                    f"after {wait_s:g} s (its sleep handler refused, is slow, or it has none)")
            time.sleep(POLL_S)
    click.echo(f"{name}: {'awake' if wake else 'asleep'}")


wait_option = click.option("--wait", "wait_s", type=click.FloatRange(min=0, max=86400),
                           default=30.0, show_default=True,
                           help="Seconds to wait for the tenant to say it did.")


@click.command()
@click.argument("name")
@wait_option
@run_dir_option
def sleep(name: str, wait_s: float, run_dir: str | None) -> None:
    """Ask tenant NAME to sleep: it releases all its KV and its weight sets (a set nobody
    holds stays cached while memory allows). Its own uid or an admin."""
    _ask(name, False, wait_s, run_dir)


@click.command()
@click.argument("name")
@wait_option
@run_dir_option
def wake(name: str, wait_s: float, run_dir: str | None) -> None:
    """Ask tenant NAME to wake: it re-attaches (or reloads) its weights; KV comes back as
    it serves. Its own uid or an admin."""
    _ask(name, True, wait_s, run_dir)


def register(cli: click.Group) -> None:
    cli.add_command(sleep)
    cli.add_command(wake)
