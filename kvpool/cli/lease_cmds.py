"""``kvpool lease SIZE -- COMMAND ...``: run a job while a lease is held.

The lease (memory the job uses through its own allocator, e.g. a training job beside
the servers) counts against the budget; the daemon reclaims from other tenants to make
room before the command starts. The lease ends when the command exits, crashed or not,
and at once if this process is killed (the daemon sees its fd channel close).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import click

from kvpool.cli.params import run_dir_option
from kvpool.sizes import format_size, parse_size


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("size")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--name", default=None, help="Tenant name (default lease-PID).")
@click.option("--device", type=int, default=0)
@click.option("--timeout", "timeout_s", type=float, default=30.0,
              help="Seconds to wait for the grant.")
@run_dir_option
def lease(size: str, command: tuple[str, ...], name: str | None, device: int,
          timeout_s: float, run_dir: str | None) -> None:
    """Hold SIZE (4GiB, or 50% of the budget) while COMMAND runs; exit with its status."""
    from kvpool.client_lib import KvpoolError, connect

    name = name or f"lease-{os.getpid()}"
    try:
        tenant = connect(name=name, device=device, run_dir=run_dir, kind="lease",
                         timeout_s=timeout_s)
    except KvpoolError as e:
        raise click.ClickException(e.message) from None
    try:
        try:
            nbytes = parse_size(size, tenant.budget)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="SIZE") from None
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
