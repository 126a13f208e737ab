"""``kvpool lease SIZE -- COMMAND ...``: run a job while a lease is held.

The lease (memory the job uses through its own allocator, e.g. a training job beside
the servers) counts against the budget; the daemon reclaims from other tenants to make
room before the command starts. The lease ends when the command exits, crashed or not,
and at once if this process is killed (the daemon sees its fd channel close).

The job learns what it holds from ``KVPOOL_LEASE_BYTES`` (bytes, the lease rounded up
to whole pages): it must keep its own allocations within that. ``--min`` and
``--shares`` are the lease tenant's knobs (a config entry for ``--name`` wins; the old
``--weight`` still works for one release). A lease may take from the others down to
what they are guaranteed (their ``min`` and leases) and the weight sets in use, whatever
its shares: a lease that cannot fit even so is refused at once, saying which of these
leaves too little.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from typing import NoReturn

import click

from kvpool.cli.params import chosen_shares, run_dir_option, shares_options
from kvpool.protocol.bounds import MAX_SHARES
from kvpool.sizes import format_size, parse_size


def _bad(option: str, message: str) -> NoReturn:
    """A bad value: one line on stderr, exit status 2, nothing leased or run."""
    click.echo(f"Error: {option}: {message}", err=True)
    sys.exit(2)


def _shares(option: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        shares = float(text)
    except ValueError:
        _bad(option, f"{text!r} is not a number")
    if not math.isfinite(shares) or not 0 < shares <= MAX_SHARES:
        _bad(option, f"{text!r}: give a number above 0 and at most {MAX_SHARES:g}")
    return shares


def _size(option: str, text: str | None, budget: int | None = None) -> int | None:
    """``text`` as bytes (a share of ``budget`` when given, else a size only)."""
    if text is None:
        return None
    if budget is None and text.strip().endswith("%"):
        _bad(option, f"{text!r}: give a size (a share of the budget is not known before "
                     "the lease registers)")
    try:
        nbytes = parse_size(text, budget)
    except ValueError as e:
        _bad(option, str(e))
    from kvpool.protocol.bounds import MAX_BYTES

    if nbytes > MAX_BYTES:
        _bad(option, f"{text!r} is too large")
    return nbytes


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("size")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--name", default=None, help="Tenant name (default lease-PID).")
@click.option("--device", type=int, default=0)
@click.option("--timeout", "timeout_s", type=float, default=30.0,
              help="Seconds to wait for the grant.")
@click.option("--min", "min_", default=None, metavar="SIZE",
              help="Guaranteed to this lease tenant: never reclaimed from it (a size).")
@shares_options("Its part of contended memory, a proportional count (default 1; above 0, "
                "at most 10000). A lease takes what the others are not guaranteed whatever "
                "its shares.")
@run_dir_option
def lease(size: str, command: tuple[str, ...], name: str | None, device: int,
          timeout_s: float, min_: str | None, shares: str | None, old_weight: str | None,
          run_dir: str | None) -> None:
    """Hold SIZE (4GiB, or 50% of the budget) while COMMAND runs; exit with its status.

    COMMAND gets KVPOOL_LEASE_BYTES in its environment: the bytes leased (SIZE rounded
    up to whole pages), what it may allocate. A lease the others' guaranteed memory
    (their --min and leases) and the weight sets in use leave no room for is refused at
    once, saying so."""
    from kvpool.client_lib import KvpoolError, connect

    name = name or f"lease-{os.getpid()}"
    min_bytes = _size("--min", min_)
    shares_value = _shares("--weight" if old_weight is not None else "--shares",
                           chosen_shares(shares, old_weight))
    try:
        tenant = connect(name=name, device=device, run_dir=run_dir, kind="lease",
                         timeout_s=timeout_s, min=min_bytes, shares=shares_value)
    except KvpoolError as e:
        raise click.ClickException(e.message) from None
    try:
        nbytes = _size("SIZE", size, tenant.budget)
        assert nbytes is not None
        try:
            held = tenant.lease(nbytes)
        except KvpoolError as e:
            raise click.ClickException(f"lease of {format_size(nbytes)}: {e.code}: {e.message}") from None
        click.echo(f"kvpool: leased {format_size(held.nbytes)} as {name}", err=True)
        env = {**os.environ, "KVPOOL_LEASE_BYTES": str(held.nbytes)}
        try:
            child = subprocess.Popen(list(command), env=env)
        except OSError as e:
            raise click.ClickException(f"cannot run {command[0]}: {e}") from None
        for sig in (signal.SIGINT, signal.SIGTERM):  # pass on, keep the lease until it exits
            signal.signal(sig, lambda s, f: child.send_signal(s))
        rc = child.wait()
    finally:
        tenant.close()
    sys.exit(rc if rc >= 0 else 128 - rc)


def register(cli: click.Group) -> None:
    cli.add_command(lease)
