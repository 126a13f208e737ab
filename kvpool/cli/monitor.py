"""The admin sessions a command talks to the daemon through: one
:class:`~kvpool.client_lib.admin.Monitor` per device a command reads, the daemon's errors
turned into one line and exit status 1. The client library is imported on use, so
``kvpool --help`` stays fast.

A daemon may serve several devices (``kvpool daemon --devices``); a monitor session
reads one. :func:`monitor_session` opens the one ``--device`` names (default: the
daemon's first); :func:`device_sessions` opens one per device shown: ``--device``'s, or
every device the daemon serves (its hello lists them). A device it does not serve is
refused by the daemon (one line, exit status 1). No daemon at the run directory: one
line saying so and what to do (start one, or point ``--run-dir`` at one), exit 1."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import click

if TYPE_CHECKING:
    from kvpool.client_lib.admin import Monitor
    from kvpool.client_lib.errors import KvpoolError


def chosen_device() -> int | None:
    """The ``--device`` of the command running (None: not given)."""
    from kvpool.cli.params import DEVICE_KEY

    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(DEVICE_KEY) if ctx is not None else None


def no_daemon_advice(e: KvpoolError) -> str:
    """``e``'s message, with what to do when it says no daemon runs there."""
    msg = e.message
    if not msg.startswith("no kvpool daemon at"):
        return msg
    if "`kvpool daemon" in msg:  # the client library's line already says what to do
        return msg
    return msg + ("; start one with `kvpool daemon`, or pass --run-dir (or set "
                  "KVPOOL_RUN_DIR) to where one runs")


def _monitor(run_dir: str | None, device: int | None) -> Monitor:
    from kvpool.client_lib.admin import Monitor
    from kvpool.client_lib.errors import KvpoolError

    try:
        return Monitor(run_dir, device=device)
    except KvpoolError as e:
        raise click.ClickException(no_daemon_advice(e)) from None


def served(mon: Monitor) -> list[int]:
    """Every device the daemon behind ``mon`` serves."""
    hello = mon.conn.hello
    if hello is None:
        return []
    return list(hello.devices) or [hello.device]


@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    """The daemon's errors end the command with one line (``code: message``, exit 1)."""
    from kvpool.client_lib.errors import KvpoolError

    try:
        yield
    except KvpoolError as e:
        raise click.ClickException(f"{e.code}: {e.message}") from None


@contextlib.contextmanager
def monitor_session(run_dir: str | None) -> Iterator[Monitor]:
    """A monitor session of ``--device``'s device (default: the daemon's first) for
    one command: the daemon's errors end it with one line, and it is closed however
    the command ends."""
    mon = _monitor(run_dir, chosen_device())
    try:
        with _one_line():
            yield mon
    finally:
        mon.close()


@contextlib.contextmanager
def device_sessions(run_dir: str | None) -> Iterator[list[Monitor]]:
    """One monitor session per device the command shows, in device order: the one
    ``--device`` names, else every device the daemon serves. Errors and closing as
    :func:`monitor_session`."""
    device = chosen_device()
    first = _monitor(run_dir, device)
    mons = [first]
    try:
        if device is None:
            mons += [_monitor(run_dir, d) for d in served(first)[1:]]
        with _one_line():
            yield mons
    finally:
        for m in mons:
            m.close()
