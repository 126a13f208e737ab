"""Daemon-side commands: ``kvpool daemon``, ``ps``, ``map``, ``limit``, ``check`` and
``stop`` (``lease`` is :mod:`kvpool.cli.lease_cmds`).

Heavy modules (zmq, the daemon, the vmm backends) are imported inside the commands so
``kvpool --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Callable, NoReturn, TypeVar

import click

from kvpool.cli.monitor import device_sessions, monitor_session
from kvpool.cli.params import (SizeParam, chosen_shares, device_option, json_option,
                               run_dir_option, shares_options)
from kvpool.protocol.bounds import MAX_SHARES
from kvpool.sizes import format_size, parse_size
from kvpool.vmm.registry import BACKENDS

if TYPE_CHECKING:
    from kvpool import protocol as p
    from kvpool.client_lib.admin import Monitor
    from kvpool.daemon.config import ConfigError

T = TypeVar("T")

GLYPHS = {"#": "█", "+": "▒", ".": "·"}
GRID_WIDTH = 64


def _call(run_dir: str | None, fn: Callable[[Monitor], T]) -> T:
    with monitor_session(run_dir) as mon:
        return fn(mon)


def _call_each(run_dir: str | None, fn: Callable[[Monitor], T]) -> list[T]:
    """``fn`` on each device shown (``--device``'s, else every device served)."""
    with device_sessions(run_dir) as mons:
        return [fn(m) for m in mons]


def _json(obj: object) -> None:
    from kvpool.protocol import to_builtins

    click.echo(json.dumps(to_builtins(obj), indent=2))


def query_command(fn: Callable[..., None]) -> click.Command:
    """A command that asks the daemon one question: ``--run-dir`` and ``--json`` options,
    the name of ``fn`` (what ``ps`` and ``check`` share)."""
    return click.command()(run_dir_option(device_option(json_option(fn))))


# configuration keys set by `kvpool daemon` flags (named so in error messages)
DAEMON_FLAGS = {"backend": "--backend", "device": "--device", "devices": "--devices",
                "budget": "--budget",
                "page_size": "--page-size", "warm_min": "--warm-min", "warm_max": "--warm-max",
                "run_dir": "--run-dir", "log_level": "--log-level",
                "socket_group": "--socket-group", "admin_group": "--admin-group",
                "reclaim_timeout_s": "--reclaim-timeout", "metrics_address": "--metrics-address",
                "metrics_allow_remote": "--metrics-allow-remote",
                "endpoints_file": "--endpoints-file", "endpoints_address": "--endpoints-address",
                "endpoints_namespace": "--endpoints-namespace"}


def _config_exit(e: ConfigError) -> NoReturn:
    """Invalid configuration: one line per problem on stderr, exit status 2."""
    for line in e.problems:
        click.echo(f"Error: configuration: {line}", err=True)
    sys.exit(2)


@click.command()
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="Memory backend (default auto: cuda if usable, else host).")
@click.option("--device", type=int, default=None, help="Device ordinal (default 0).")
@click.option("--devices", default=None,
              help="Serve several devices, a pool and a budget each: 'all', a count N "
                   "(devices 0..N-1; on host, N independent pools, each an equal share "
                   "of RAM) or a list '0,1'.")
@click.option("--budget", type=SizeParam(percent=True), default=None,
              help="Bytes the daemon may hand out: a size or a share of device memory "
                   "(default 80%).")
@click.option("--page-size", type=SizeParam(), default=None,
              help="Page size (default: the backend's, 2MiB).")
@click.option("--warm-min", type=SizeParam(), default=None,
              help="Zeroed memory kept ready for fast grants (a size; default 0).")
@click.option("--warm-max", type=SizeParam(), default=None,
              help="Most zeroed memory kept ready (a size; default 256MiB).")
@run_dir_option
@click.option("--socket-group", default=None,
              help="Group owning the run directory (0750) and sockets (0660).")
@click.option("--admin-group", default=None,
              help="Members may change other tenants' knobs and stop the daemon.")
@click.option("--reclaim-timeout", "reclaim_timeout_s", type=float, default=None,
              help="Seconds a reclaim may take before a waiting grant gets NO_MEMORY (2).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              default=None, help="TOML configuration file (flags override it).")
@click.option("--log-level", default=None,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--metrics-address", default=None, metavar="HOST:PORT",
              help="Serve Prometheus metrics here (loopback only; off by default).")
@click.option("--metrics-allow-remote", is_flag=True, default=None,
              help="Allow a --metrics-address that is not loopback (tenant names show).")
@click.option("--endpoints-file", default=None, metavar="PATH",
              help="Keep a cluster router's file-discovery list (endpoints.yaml) of the "
              "servers registered here: each one that registered where it serves.")
@click.option("--endpoints-address", default=None, metavar="ADDRESS",
              help="The address routers reach those servers at, for --endpoints-file "
              "[default: this machine's address by its host name].")
@click.option("--endpoints-namespace", default=None, metavar="NAME",
              help="The namespace of the entries of --endpoints-file [default: default].")
@json_option
def daemon(backend: str | None, device: int | None, devices: str | None,
           budget: int | str | None,
           page_size: int | None, warm_min: int | None, warm_max: int | None,
           run_dir: str | None, socket_group: str | None, admin_group: str | None,
           reclaim_timeout_s: float | None, config_path: str | None, log_level: str | None,
           as_json: bool, metrics_address: str | None = None,
           metrics_allow_remote: bool | None = None, endpoints_file: str | None = None,
           endpoints_address: str | None = None,
           endpoints_namespace: str | None = None) -> None:
    """Run the kvpool daemon in the foreground (systemd: Type=notify)."""
    import logging

    from kvpool.daemon.config import Config, ConfigError
    from kvpool.daemon.server import Server, StartupError

    try:
        cfg = Config.load(config_path, labels=DAEMON_FLAGS, backend=backend, device=device,
                          devices=devices, budget=budget, page_size=page_size, warm_min=warm_min,
                          warm_max=warm_max, run_dir=run_dir, log_level=log_level,
                          socket_group=socket_group, admin_group=admin_group,
                          reclaim_timeout_s=reclaim_timeout_s, metrics_address=metrics_address,
                          metrics_allow_remote=metrics_allow_remote,
                          endpoints_file=endpoints_file, endpoints_address=endpoints_address,
                          endpoints_namespace=endpoints_namespace)
    except ConfigError as e:
        _config_exit(e)
    logging.basicConfig(
        level=cfg.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if not as_json else
        '{"time":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}')
    from kvpool.vmm import VmmError

    try:
        server = Server(cfg)
    except ConfigError as e:  # what needs the device: the budget, tenants' min
        _config_exit(e)
    except (ValueError, OSError, VmmError) as e:
        raise click.ClickException(str(e)) from None
    try:
        server.serve()
    except StartupError as e:
        raise click.ClickException(str(e)) from None


@query_command
def ps(run_dir: str | None, as_json: bool) -> None:
    """List tenants: name, pid, kind, mapped, chunk (the allocation unit: what one grant
    of its KV maps and one release frees), in use, reserve, limit, state (asleep,
    idle, busy; sleepable) (and the endpoint
    a tenant says it serves on, when one does; the weight sets it holds, when any
    does; the fleet it belongs to, when one does); then the retained memory per uid and
    the pool's weight sets. A daemon serving several devices: every device's (a DEVICE
    column), or --device's."""
    from kvpool import protocol as p

    replies = _call_each(run_dir, lambda m: m.ps())
    pools = [r.pool for r in replies if r.pool is not None]
    retained: dict[int, int] = {}
    for r in replies:  # (charged per device: summed per uid)
        for uid, n in r.retained_by_uid.items():
            retained[uid] = retained.get(uid, 0) + n
    reply = p.PsReply(tenants=[t for r in replies for t in r.tenants],
                      pool=pools[0] if pools else None, retained_by_uid=retained)
    if as_json:
        _json({"tenants": reply.tenants, "pool": reply.pool, "pools": pools,
               "retained_by_uid": reply.retained_by_uid})
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    several = len(replies) > 1
    cols: tuple[str, ...] = ("ID", "NAME", "PID", "KIND", *(("DEVICE",) if several else ()),
                             "MAPPED", "CHUNK", "IN USE", "RESERVE", "LEASE", "FAIR SHARE",
                             "MIN", "LIMIT", "SHARES", "GROUPS", "STATE")
    serving = any(t.endpoint for t in reply.tenants)  # (tenant-supplied: Register.endpoint)
    cols += ("ENDPOINT",) if serving else ()
    weights = any(t.weights for t in reply.tenants)  # weight sets (kvpool.daemon.weights)
    cols += ("WEIGHTS", "SETS") if weights else ()
    fleets = any(t.group for t in reply.tenants)  # (tenant-supplied: Register.group)
    cols += ("FLEET",) if fleets else ()
    for col in cols:
        table.add_column(col, justify="left" if col in ("NAME", "KIND", "STATE") else "right")
    for t in reply.tenants:
        state: list[str] = []
        if t.state != "awake" or t.sleepable:  # (kvpool.daemon.sleepers)
            state.append(t.state + (" (sleepable)" if t.sleepable else ""))
        if t.unresponsive:
            state.append(f"UNRESPONSIVE (ignored {t.ignored})")
        elif t.ignored:
            state.append(f"ignored {t.ignored}")
        if t.asked:
            state.append(f"asked {format_size(t.asked)}")
        if t.waiting:
            state.append(f"waiting {format_size(t.waiting)}")
        if t.retained:  # released pages it still holds a descriptor or mapping of
            state.append(f"retained {format_size(t.retained)}")
        table.add_row(str(t.id), t.name or "(unregistered)", str(t.pid) if t.pid else "-",
                      t.kind, *((str(t.device),) if several else ()),
                      format_size(t.mapped), format_size(t.chunk) if t.chunk else "-",
                      format_size(t.in_use), format_size(t.reserve),
                      format_size(t.lease), format_size(t.fair_share), format_size(t.min),
                      format_size(t.max), f"{t.shares:g}", str(t.groups), ", ".join(state),
                      *((t.endpoint or "-",) if serving else ()),
                      *((format_size(t.weights), ",".join(t.weight_sets) or "-")
                        if weights else ()),
                      *((t.group or "-",) if fleets else ()))
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    for pool in pools:
        if not pool.weight_sets:
            continue
        on = f" (device {pool.device})" if several else ""
        held, cached = pool.weights - pool.weights_cached, pool.weights_cached
        nobody = "cached (held by nobody; reclaimed first)"
        where = (", all held by tenants" if not cached else f", all {nobody}" if not held
                 else f": {format_size(held)} held by tenants, {format_size(cached)} {nobody}")
        console.print(f"weight sets{on}: {pool.weight_sets}, {format_size(pool.weights)} in the "
                      f"pool{where}"
                      + ("" if pool.weights_across_uids else
                         f"; the {pool.backend} backend has no seals: each set, an admin's "
                         "too, is attachable by its creator's uid only"))
    if reply.retained_by_uid:  # released pages still referenced, charged to each uid
        console.print("retained by uid: " + ", ".join(
            f"uid {uid} {format_size(n)}" for uid, n in sorted(reply.retained_by_uid.items())))


def render_map(reply: p.MapReply, width: int = GRID_WIDTH) -> str:
    """The memory map as text: one grid per group, then the pool."""
    lines: list[str] = []
    pool = reply.pool
    ps_ = pool.page_size
    for g in reply.groups:
        used = g.in_use_units  # the table arrives run-length encoded (GroupInfo.runs)
        res = g.reserve_units
        lines.append(
            f"group {g.id} {g.label or ''}".rstrip()
            + f" — tenant {g.tenant_name or '?'} (id {g.tenant}): {g.n_regions} region(s) x "
            f"{g.npages} pages of {format_size(ps_)}, granted {g.chunk_units} unit(s) "
            f"({format_size(g.chunk_units * g.n_regions * ps_)}) at a time; units in use "
            f"{used}, reserve {res}, unmapped {g.npages - used - res}")
        if g.bases:
            shown = ", ".join(f"{b:#x}" for b in g.bases[:4])
            more = f", ... ({len(g.bases)} regions)" if len(g.bases) > 4 else ""
            lines.append(f"  bases: {shown}{more}")
        for start in range(0, g.npages, width):
            row = "".join(GLYPHS[c] for c in g.cells(start, start + width))
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
@device_option
@json_option
def map_cmd(tenant: str | None, pfns: bool, width: int, run_dir: str | None,
            as_json: bool) -> None:
    """Draw every region's virtual page table and the pool (the memory map); a daemon
    serving several devices: one section per device (or --device's)."""
    from kvpool.protocol import to_builtins

    replies = _call_each(run_dir, lambda m: m.map(tenant, pfns=pfns))
    if as_json:
        _json({"pool": replies[0].pool, "pools": [r.pool for r in replies],
               "groups": [{**to_builtins(g), "device": r.pool.device}
                          for r in replies for g in r.groups]})
        return
    if len(replies) == 1:
        click.echo(render_map(replies[0], width))
        return
    click.echo("\n\n".join(f"== device {r.pool.device} ==\n{render_map(r, width)}"
                           for r in replies))


@click.command()
@click.argument("tenant")
@click.argument("size", required=False)
@click.option("--max", "max_", default=None, help="Hard limit (same as SIZE).")
@click.option("--min", "min_", default=None, help="Guaranteed memory, never reclaimed.")
@shares_options("Its part of contended memory, a proportional count (default 1).",
                type=click.FloatRange(min=0, min_open=True, max=MAX_SHARES))
@click.option("--wait", "wait_s", type=click.FloatRange(0, 3600), default=0.0,
              help="Wait up to this many seconds for the memory above the limit to be freed.")
@run_dir_option
@json_option
def limit(tenant: str, size: str | None, max_: str | None, min_: str | None,
          shares: float | None, old_weight: float | None, wait_s: float, run_dir: str | None,
          as_json: bool) -> None:
    """Set TENANT's knobs: hard limit SIZE (8GiB, or 25% of the budget), --min, --shares.

    Lowering the limit below what the tenant holds starts reclaim at once (idle or not);
    the command reports the change as applied or pending with the bytes still to free.
    For a TENANT not connected, the command says so: the knobs wait for one to register.
    Needs an admin identity (root, the daemon's user, or the configured admin group)."""
    import time

    from kvpool import protocol as p

    shares = chosen_shares(shares, old_weight)
    if size is not None and max_ is not None:
        raise click.UsageError("give the limit as SIZE or --max, not both")
    size = size if size is not None else max_

    def go(mon: Monitor) -> tuple[dict[str, int], p.LimitSet]:
        stats = mon.stats()
        out: dict[str, int] = {}
        for key, text in (("max", size), ("min", min_)):
            if text is None:
                continue
            try:
                out[key] = parse_size(text, stats.pool.budget)
            except ValueError as e:
                _bad_value(key.upper(), str(e))
            if out[key] > p.MAX_BYTES:
                _bad_value(key.upper(), f"{text!r} is too large")
        if not out and shares is None:
            raise click.UsageError("nothing to change: give SIZE, --min or --shares")
        reply = mon.set_limit(tenant, out.get("max"), min=out.get("min"), shares=shares)
        deadline = time.monotonic() + wait_s
        while not reply.applied and time.monotonic() < deadline:
            time.sleep(0.05)
            held = sum(max(0, t.mapped - max(0, t.max - t.lease))
                       for t in mon.ps().tenants if t.name == tenant)
            reply = p.LimitSet(tenant=tenant, tenants=reply.tenants, applied=held == 0,
                               pending=held)
        return out, reply

    out, reply = _call(run_dir, go)
    if as_json:
        click.echo(json.dumps({"tenant": tenant, **out,
                               **({"shares": shares} if shares is not None else {}),
                               "connected": reply.tenants, "applied": reply.applied,
                               "pending": reply.pending}))
        return
    if not reply.tenants:
        click.echo(f"no tenant named {tenant} is connected: "
                   f"{'; '.join(_knob_changes(tenant, out, shares))}, to apply when one "
                   f"registers")
        return
    click.echo("; ".join(_knob_changes(tenant, out, shares)))
    if not reply.applied:
        click.echo(f"pending: {format_size(reply.pending)} still to free")


def _bad_value(what: str, why: str) -> NoReturn:
    """A bad argument: one line on stderr, exit status 2 (nothing was changed)."""
    click.echo(f"Error: {what}: {why}", err=True)
    sys.exit(2)


def _knob_changes(tenant: str, out: dict[str, int], shares: float | None) -> list[str]:
    parts = [f"limit of {tenant} set to {format_size(out['max'])}"] if "max" in out else []
    if "min" in out:
        parts.append(f"min of {tenant} set to {format_size(out['min'])}")
    if shares is not None:
        parts.append(f"shares of {tenant} set to {shares:g}")
    return parts


@click.command()
@run_dir_option
def stop(run_dir: str | None) -> None:
    """Stop the daemon (admin identity needed). Tenants keep their mapped pages."""
    _call(run_dir, lambda m: m.shutdown())
    click.echo("stopping")


@query_command
def check(run_dir: str | None, as_json: bool) -> None:
    """Run the daemon's invariant check (exit status 1 if it finds problems): every
    device's, or --device's."""
    def each(m: Monitor) -> list[str]:
        found = m.check()
        several = len(m.conn.hello.devices) > 1 if m.conn.hello is not None else False
        where = f"device {m.stats().pool.device}: " if several and found else ""
        return [where + x for x in found]

    problems = [x for found in _call_each(run_dir, each) for x in found]
    if as_json:
        click.echo(json.dumps({"ok": not problems, "problems": problems}))
    else:
        click.echo("ok" if not problems else "\n".join(problems))
    if problems:
        sys.exit(1)


def register(cli: click.Group) -> None:
    for cmd in (daemon, ps, map_cmd, limit, check, stop):
        cli.add_command(cmd)
