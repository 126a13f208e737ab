"""``kvpool fleet FLEET.toml``: one OpenAI-compatible endpoint for every model of a fleet
file (:mod:`kvpool.fleet`).

A fleet file with problems prints one line per problem (``FILE: models[2].max: ...``)
and exits 2 before anything starts; a fleet that cannot start (no daemon, a port in
use, its daemon did not start) prints one line and exits 1.
"""

from __future__ import annotations

import sys

import click

from kvpool.cli.extras import require


def register(cli: click.Group) -> None:
    @cli.command()
    @click.argument("fleet_file", metavar="FLEET.toml")
    @click.option("--with-daemon", is_flag=True, help="start a daemon from the file's "
                  "[daemon] table (default: use the running one: KVPOOL_RUN_DIR, or the "
                  "default run directory)")
    @click.option("--host", default=None, help="[default: the file's fleet.host, 127.0.0.1]")
    @click.option("--port", default=None, type=click.IntRange(0, 65535),
                  help="[default: the file's fleet.port, 8080; 0: any free port]")
    @click.option("--log-dir", default=None, type=click.Path(file_okay=False),
                  help="where the members' (and daemon's) logs go [default: a new folder "
                  "under the temp dir]")
    @click.option("--endpoints-file", default=None, type=click.Path(dir_okay=False),
                  help="keep a cluster router's file-discovery list of this fleet's "
                  "endpoints (endpoints.yaml: one per model, with its state) at this path")
    @click.option("--endpoints-address", default=None, help="the address routers reach the "
                  "fleet at, for --endpoints-file [default: --host, or this machine's "
                  "address when it listens on all]")
    @click.option("--endpoints-namespace", default="default", show_default=True,
                  help="the namespace of the entries of --endpoints-file")
    def fleet(fleet_file: str, with_daemon: bool, host: str | None, port: int | None,
              log_dir: str | None, endpoints_file: str | None,
              endpoints_address: str | None, endpoints_namespace: str) -> None:
        """Serve every model of FLEET.toml on one OpenAI-compatible endpoint: each a
        sleepable tenant of the daemon, started on its first request (or at start),
        put to sleep when idle or when memory is short, woken by a request."""
        require("engine", "fleet")
        from kvpool.discovery import address_problem, namespace_problem
        from kvpool.fleet.config import FleetConfigError, load

        for flag, why in (("--endpoints-address", endpoints_address is not None
                           and address_problem(endpoints_address)),
                          ("--endpoints-namespace", namespace_problem(endpoints_namespace))):
            if why:
                click.echo(f"Error: {flag}: {why}", err=True)
                sys.exit(2)

        try:
            config = load(fleet_file, with_daemon=with_daemon)
        except FleetConfigError as e:
            for line in e.problems:
                click.echo(line, err=True)
            sys.exit(2)
        from kvpool.fleet.service import FleetError, serve

        try:
            serve(config, with_daemon=with_daemon, host=host, port=port, log_dir=log_dir,
                  endpoints_file=endpoints_file, endpoints_address=endpoints_address,
                  endpoints_namespace=endpoints_namespace)
        except FleetError as e:
            raise click.ClickException(str(e)) from None
