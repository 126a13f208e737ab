"""The ``kvpool`` command: one click group; each concern registers its commands."""

from __future__ import annotations

import click

from kvpool import __version__
from kvpool.cli import (
    daemon_cmds,
    demo_cmds,
    engine_cmds,
    events_cmd,
    fleet_cmds,
    lease_cmds,
    sleep_cmds,
    top,
    vmm_cmds,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvpool")
def cli() -> None:
    """kvpool: share one accelerator's memory between model servers and jobs."""


for module in (vmm_cmds, daemon_cmds, lease_cmds, engine_cmds, demo_cmds, events_cmd, top,
               sleep_cmds, fleet_cmds):
    module.register(cli)


if __name__ == "__main__":
    cli()
