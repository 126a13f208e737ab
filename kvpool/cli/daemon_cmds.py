"""Daemon-side commands: ``kvpool daemon``, ``ps``, ``map``, ``limit``, ``check``.

Heavy modules (zmq, the daemon, the vmm backends) are imported inside the commands so
``kvpool --help`` stays fast.
"""

from __future__ import annotations

import json
import sys

import click

from kvpool.sizes import format_size, parse_size

GLYPHS = {"#": "█", "+": "▒", ".": "·"}
GRID_WIDTH = 64


class SizeParam(click.ParamType):
    """A size (``512MiB``, ``2G``, bytes) or, when ``percent`` is allowed, ``30%``."""

    name = "size"

    def __init__(self, percent: bool = False):
        self.percent = percent

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            if text.endswith("%"):
                if not self.percent:
                    raise ValueError(f"{text!r}: a percentage is not allowed here")
                parse_size(text, 100)  # validate now, resolve against the device later
                return text
            return parse_size(text)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _monitor(run_dir):
    from kvpool.client_lib.admin import Monitor
    from kvpool.client_lib.errors import KvpoolError

    try:
        return Monitor(run_dir)
    except KvpoolError as e:
        raise click.ClickException(e.message) from None


def _call(run_dir, fn):
    from kvpool.client_lib.errors import KvpoolError

    mon = _monitor(run_dir)
    try:
        return fn(mon)
    except KvpoolError as e:
        raise click.ClickException(f"{e.code}: {e.message}") from None
    finally:
        mon.close()


def _json(obj) -> None:
    from kvpool.protocol import to_builtins

    click.echo(json.dumps(to_builtins(obj), indent=2))


run_dir_option = click.option(
    "--run-dir", type=click.Path(file_okay=False), default=None,
    help="Daemon run directory (default: $KVPOOL_RUN_DIR, /run/kvpool, "
         "$XDG_RUNTIME_DIR/kvpool or /tmp/kvpool-$UID).")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.command()
@click.option("--backend", type=click.Choice(["auto", "host", "cuda"]), default=None,
              help="Memory backend (default auto: cuda if usable, else host).")
@click.option("--device", type=int, default=None, help="Device ordinal (default 0).")
@click.option("--budget", type=SizeParam(percent=True), default=None,
              help="Bytes the daemon may hand out: a size or a share of device memory "
                   "(default 80%).")
@click.option("--page-size", type=SizeParam(), default=None,
              help="Page size (default: the backend's, 2MiB).")
@click.option("--warm-min", type=SizeParam(), default=None, help="Zeroed pages kept ready.")
@click.option("--warm-max", type=SizeParam(), default=None, help="Most zeroed pages kept.")
@run_dir_option
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              default=None, help="TOML configuration file (flags override it).")
@click.option("--log-level", default=None,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@json_option
def daemon(backend, device, budget, page_size, warm_min, warm_max, run_dir, config_path,
           log_level, as_json):
    """Run the kvpool daemon in the foreground (systemd: Type=notify)."""
    import logging

    from kvpool.daemon.config import Config
    from kvpool.daemon.server import Server, StartupError

    try:
        cfg = Config.load(config_path, backend=backend, device=device, budget=budget,
                          page_size=page_size, warm_min=warm_min, warm_max=warm_max,
                          run_dir=run_dir, log_level=log_level)
    except (ValueError, TypeError, OSError) as e:
        raise click.ClickException(f"configuration: {e}") from None
    logging.basicConfig(
        level=cfg.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if not as_json else
        '{"time":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}')
    from kvpool.vmm import VmmError

    try:
        server = Server(cfg)
    except (ValueError, OSError, VmmError) as e:
        raise click.ClickException(str(e)) from None
    try:
        server.serve()
    except StartupError as e:
        raise click.ClickException(str(e)) from None


@click.command()
@run_dir_option
@json_option
def ps(run_dir, as_json):
    """List tenants: name, pid, kind, mapped, in use, reserve, limit."""
    reply = _call(run_dir, lambda m: m.ps())
    if as_json:
        _json({"tenants": reply.tenants, "pool": reply.pool})
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for col in ("ID", "NAME", "PID", "KIND", "MAPPED", "IN USE", "RESERVE", "LIMIT", "GROUPS"):
        table.add_column(col, justify="right" if col not in ("NAME", "KIND") else "left")
    for t in reply.tenants:
        table.add_row(str(t.id), t.name or "(unregistered)", str(t.pid), t.kind,
                      format_size(t.mapped), format_size(t.in_use), format_size(t.reserve),
                      format_size(t.max), str(t.groups))
    Console().print(table)


def render_map(reply, width: int = GRID_WIDTH) -> str:
    """The memory map as text: one grid per group, then the pool."""
    lines: list[str] = []
    pool = reply.pool
    ps_ = pool.page_size
    for g in reply.groups:
        used = g.table.count("#")
        res = g.table.count("+")
        lines.append(
            f"group {g.id} {g.label or ''}".rstrip()
            + f" — tenant {g.tenant_name or '?'} (id {g.tenant}): {g.n_regions} region(s) x "
            f"{g.npages} pages of {format_size(ps_)}; units in use {used}, reserve {res}, "
            f"unmapped {g.npages - used - res}")
        if g.bases:
            shown = ", ".join(f"{b:#x}" for b in g.bases[:4])
            more = f", ... ({len(g.bases)} regions)" if len(g.bases) > 4 else ""
            lines.append(f"  bases: {shown}{more}")
        for start in range(0, g.npages, width):
            row = "".join(GLYPHS[c] for c in g.table[start : start + width])
            lines.append(f"  {start:>7} {row}")
    if not reply.groups:
        lines.append("no region groups")
    lines.append("")
    lines.append(
        f"pool ({pool.backend}, device {pool.device}, page {format_size(ps_)}): "
        f"budget {format_size(pool.budget)}, granted {format_size(pool.granted)}, "
        f"warm {format_size(pool.warm)}, dirty {format_size(pool.dirty)}, "
        f"free {format_size(pool.free)}")
    lines.append(f"legend: {GLYPHS['#']} in use  {GLYPHS['+']} mapped reserve  "
                 f"{GLYPHS['.']} unmapped")
    return "\n".join(lines)


@click.command(name="map")
@click.argument("tenant", required=False)
@click.option("--pfns", is_flag=True, help="Include each unit's page ids (JSON only).")
@click.option("--width", type=click.IntRange(8, 1024), default=GRID_WIDTH, help="Grid width.")
@run_dir_option
@json_option
def map_cmd(tenant, pfns, width, run_dir, as_json):
    """Draw every region's virtual page table and the pool (the memory map)."""
    reply = _call(run_dir, lambda m: m.map(tenant, pfns=pfns))
    if as_json:
        _json({"pool": reply.pool, "groups": reply.groups})
        return
    click.echo(render_map(reply, width))


@click.command()
@click.argument("tenant")
@click.argument("size")
@run_dir_option
@json_option
def limit(tenant, size, run_dir, as_json):
    """Set TENANT's hard limit to SIZE (e.g. 8GiB, or 25% of the budget)."""
    from kvpool import protocol as p

    def go(mon):
        stats = mon.stats()
        try:
            nbytes = parse_size(size, stats.pool.budget)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="SIZE") from None
        if nbytes > p.MAX_BYTES:
            raise click.BadParameter(f"{size!r} is too large", param_hint="SIZE")
        mon.set_limit(tenant, nbytes)
        return nbytes

    nbytes = _call(run_dir, go)
    if as_json:
        click.echo(json.dumps({"tenant": tenant, "max": nbytes}))
    else:
        click.echo(f"limit of {tenant} set to {format_size(nbytes)}")


@click.command()
@run_dir_option
@json_option
def check(run_dir, as_json):
    """Run the daemon's invariant check (exit status 1 if it finds problems)."""
    problems = _call(run_dir, lambda m: m.check())
    if as_json:
        click.echo(json.dumps({"ok": not problems, "problems": problems}))
    else:
        click.echo("ok" if not problems else "\n".join(problems))
    if problems:
        sys.exit(1)


def register(cli: click.Group) -> None:
    for cmd in (daemon, ps, map_cmd, limit, check):
        cli.add_command(cmd)
