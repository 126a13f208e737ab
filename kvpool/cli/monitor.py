"""The admin session a command talks to the daemon through: one
:class:`~kvpool.client_lib.admin.Monitor` per command, the daemon's errors turned into one
line and exit status 1. The client library is imported on use, so ``kvpool --help``
stays fast."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import click

if TYPE_CHECKING:
    from kvpool.client_lib.admin import Monitor


def _monitor(run_dir: str | None) -> Monitor:
    from kvpool.cli.params import DEVICE_KEY
    from kvpool.client_lib.admin import Monitor
    from kvpool.client_lib.errors import KvpoolError

    ctx = click.get_current_context(silent=True)
    device = ctx.meta.get(DEVICE_KEY) if ctx is not None else None
    try:
        return Monitor(run_dir, device=device)
    except KvpoolError as e:
        raise click.ClickException(e.message) from None


@contextlib.contextmanager
def monitor_session(run_dir: str | None) -> Iterator[Monitor]:
    """A monitor session for one command: the daemon's errors end it with one line
    (``code: message``, exit status 1), and it is closed however the command ends."""
    from kvpool.client_lib.errors import KvpoolError

    mon = _monitor(run_dir)
    try:
        yield mon
    except KvpoolError as e:
        raise click.ClickException(f"{e.code}: {e.message}") from None
    finally:
        mon.close()
