"""How the fleet demo starts a fleet mode, under any policy: :func:`launch`, the one
place that knows.

Through ``kvpool fleet`` (issue 23; docs/ARCHITECTURE.md, "Fleet"): the demo writes
``FLEET.toml`` (:func:`fleet_toml`: every model a sleepable elastic member with its
weights in the pool, put to sleep when idle ``sleep_after`` seconds or when the daemon
needs its memory), starts ``kvpool fleet FLEET.toml`` on the daemon the run started
(``KVPOOL_RUN_DIR``; the file's ``[daemon]`` section is what ``--with-daemon`` would
start, so the file also runs on its own). Every request then goes to the one endpoint.

Members start *in waves* before the workload, so that server start-up is not in the
measured window and never outruns the memory: a wave of as many models as fit is
started (a fleet's lazy members by one warm-up request each), then put to sleep
(``kvpool sleep``: the daemon asks them) before the next wave; the last wave stays
awake. (Started all at once, six servers whose weights fill the pool before any of
them is idle leave a seventh grant, the last server's null block, nothing to reclaim:
that server exits.)

A fleet under a peer's policy (``policy``: ``swap``, ``idle-sleep``, ``reconcile``; issue
36, docs/ARCHITECTURE.md "Fleet policies") is a baseline: its file names the policy and
its knobs and leaves out the member keys the policy sets itself, and it runs on a daemon
of its own (``kvpool fleet --with-daemon``, the same budget and page size from the
file's ``[daemon]``; its run directory is read from the fleet's log). Its warm-up is
the same requests, sent to every member at once, and nothing is put to sleep (the
policy decides what loads, waits or fails: swap unloads, idle-sleep and reconcile sleep
idle members by their own timers); a member the policy cannot start in time is named in
``Launched.not_ready`` rather than failing the run: its requests meet what that policy
gives them.

Where this kvpool has no ``kvpool fleet`` (no ``kvpool.fleet.router``) the same members
start as plain servers (``kvpool serve --elastic --weights pool --sleepable
--sleep-after S``), one endpoint each, and the report says so (``Launched.via``).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import httpx

from kvpool import launch as proc_launch
from kvpool.client_lib import Monitor
from kvpool.demo.cluster import Cluster, ClusterError, Proc, free_port
from kvpool.demo.driver import warm_up, warm_up_all

VIA_FLEET = "kvpool fleet"
VIA_DIRECT = "direct servers (no kvpool fleet here)"


@dataclass(frozen=True)
class Member:
    """One model of the fleet and what its server gets."""

    name: str
    checkpoint: Path
    kv_cache_size: int  # virtual KV reservation (bytes)
    max_bytes: int  # the tenant's max: weights + KV
    sleep_after_s: float
    max_num_seqs: int
    block_size: int
    engine: str = "bundled"  # a kind of kvpool.fleet.engines.KINDS
    args: tuple[str, ...] = ()  # the engine's own flags; () = the bundled engine's below


@dataclass
class Launched:
    """Where the fleet serves each model, how it was started, where its logs are."""

    urls: dict[str, str]
    via: str
    log_dir: Path
    metrics_url: str | None = None  # the fleet's (``/metrics``); None for direct servers
    extra: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None  # a baseline fleet's own daemon (``--with-daemon``)
    fleet_log: Path | None = None  # the ``kvpool fleet`` process's own log
    not_ready: tuple[str, ...] = ()  # members a baseline's warm-up could not start


def fleet_available() -> bool:
    return importlib.util.find_spec("kvpool.fleet.router") is not None


def _size(n: int) -> str:
    return f"{n >> 20}MiB" if n % (1 << 20) == 0 else str(n)


def fleet_toml(members: Sequence[Member], toml_dir: Path, budget: int, page_size: int,
               name: str = "demo", port: int = 8080, policy: str = "kvpool",
               knobs: Mapping[str, float] | None = None, start_timeout_s: float = 180.0,
               static_kv: int | None = None) -> str:
    """The FLEET.toml of ``members`` (checkpoints relative to ``toml_dir``) under
    ``policy`` with ``knobs``; a baseline's file leaves out the model keys the policy sets
    itself. ``static_kv``: the KV a policy with static KV gives each member (swap: the
    context x slots allocated at load) instead of the elastic reservation."""
    from kvpool.fleet.policies import FLEET_POLICIES

    pol = FLEET_POLICIES.lookup(policy)
    decided = set(pol.decides)
    lines = [f"# Written by `kvpool demo` (scenario fleet): policy {policy!r}. Runs alone "
             "too: kvpool fleet FLEET.toml --with-daemon", "",
             "[fleet]", f'name = "{name}"', 'host = "127.0.0.1"', f"port = {port}",
             "queue = 64", f"start_timeout_s = {start_timeout_s:g}"]
    if policy != "kvpool":
        lines.append(f'policy = "{policy}"')
        lines += [f"{k} = {v:g}" for k, v in sorted((knobs or {}).items())]
    lines += ["", "[daemon]", f'budget = "{_size(budget)}"',
              f'page_size = "{_size(page_size)}"', 'backend = "host"']
    for m in members:
        rel = os.path.relpath(m.checkpoint, toml_dir)
        kv = m.kv_cache_size if pol.elastic or static_kv is None else static_kv
        keys = [("eager", "false"), ("min", '"0"'), ("max", f'"{_size(m.max_bytes)}"'),
                ("shares", "1.0"), ("sleepable", "true"),
                ("sleep_after", repr(m.sleep_after_s))]
        if m.engine == "bundled":  # (a vLLM server keeps its weights local)
            keys.append(("weights", '"pool"'))
        args = m.args or ("--block-size", str(m.block_size), "--device", "cpu")
        lines += ["", "[[models]]", f'name = "{m.name}"', f'checkpoint = "{rel}"',
                  f'engine = "{m.engine}"', "replicas = 1"]
        lines += [f"{k} = {v}" for k, v in keys if k not in decided]
        lines += [f'kv_cache_size = "{_size(kv)}"', f"max_num_seqs = {m.max_num_seqs}",
                  "args = [" + ", ".join(f'"{a}"' for a in args) + "]"]
    return "\n".join(lines) + "\n"


def launch(cluster: Cluster, members: Sequence[Member], toml_path: Path, budget: int,
           page_size: int, env: dict[str, str], wave: int, timeout_s: float = 180.0,
           policy: str = "kvpool", knobs: Mapping[str, float] | None = None,
           member_start_timeout_s: float = 180.0, static_kv: int | None = None
           ) -> Launched:
    """Start the fleet of ``members`` under ``policy`` on ``cluster``'s daemon (started
    before; a baseline starts its own), ``wave`` members at a time, and return once every
    member has served a warm-up request (a baseline: or could not be started by its
    policy, ``Launched.not_ready``). Raises :class:`ClusterError` (with the log's tail)."""
    baseline = policy != "kvpool"
    if cluster.run_dir is None and not baseline:
        raise ClusterError("start the daemon before the fleet")
    toml_path.parent.mkdir(parents=True, exist_ok=True)
    toml_path.write_text(fleet_toml(members, toml_path.parent, budget, page_size,
                                    policy=policy, knobs=knobs,
                                    start_timeout_s=member_start_timeout_s,
                                    static_kv=static_kv))
    waves = [list(members[i:i + max(1, wave)]) for i in range(0, len(members), max(1, wave))]
    if baseline:
        return _baseline(cluster, members, toml_path, env, timeout_s)
    assert cluster.run_dir is not None
    monitor = Monitor(cluster.run_dir)
    try:
        if not fleet_available():
            return _direct(cluster, waves, env, monitor, timeout_s)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_dir = cluster.workdir / "members"
        argv = [*proc_launch.cli_argv(), "fleet", str(toml_path), "--port", str(port),
                "--log-dir", str(log_dir)]
        proc = cluster.start("fleet", argv,
                             env={**env, "KVPOOL_RUN_DIR": str(cluster.run_dir)}, url=url)
        cluster.wait_healthy(timeout_s)
        for i, group in enumerate(waves):
            try:
                warm_up_all({m.name: url for m in group}, timeout_s)
            except httpx.HTTPError as e:
                raise ClusterError(f"kvpool fleet: a warm-up request failed ({e}); "
                                   f"/v1/models: {_states(url)}\n{proc.tail()}") from None
            if i < len(waves) - 1:
                _sleep(monitor, group, timeout_s)
        return Launched({m.name: url for m in members}, VIA_FLEET, log_dir, metrics_url=url,
                        fleet_log=proc.log)
    finally:
        monitor.close()


RUN_DIR_LINE = re.compile(r"started a daemon on run dir (\S+)")


def _baseline(cluster: Cluster, members: Sequence[Member], toml_path: Path,
              env: dict[str, str], timeout_s: float) -> Launched:
    """A baseline policy's fleet: ``kvpool fleet --with-daemon``, every member warmed up
    at once (one wave: the policy decides which load, wait or fail; nothing is put to
    sleep by the demo); a warm-up the policy does not serve is a member ``not_ready``,
    not an error."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_dir = cluster.workdir / "members"
    argv = [*proc_launch.cli_argv(), "fleet", str(toml_path), "--with-daemon", "--port",
            str(port), "--log-dir", str(log_dir)]
    # (whatever KVPOOL_RUN_DIR the harness has, --with-daemon makes a run dir of its own)
    proc = cluster.start("fleet", argv, env=env, url=url)
    cluster.wait_healthy(timeout_s)
    found = RUN_DIR_LINE.search(proc.log.read_text(errors="replace"))
    if found is None:
        raise ClusterError(f"kvpool fleet --with-daemon did not say its run dir:\n"
                           f"{proc.tail()}")
    not_ready: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
        futures = {m.name: pool.submit(warm_up, url, m.name, timeout_s) for m in members}
        for name, f in futures.items():
            try:
                f.result()
            except httpx.HTTPError:
                not_ready.append(name)
    cluster.check_alive()
    return Launched({m.name: url for m in members}, VIA_FLEET, log_dir, metrics_url=url,
                    run_dir=Path(found.group(1)), fleet_log=proc.log,
                    not_ready=tuple(not_ready))


def _sleep(monitor: Monitor, group: Sequence[Member], timeout_s: float) -> None:
    """Ask each member of ``group`` to sleep and wait until ``ps`` shows it asleep."""
    names = {m.name for m in group}
    for name in names:
        monitor.sleep(name)
    deadline = time.monotonic() + timeout_s
    while True:
        states = {t.name: t.state for t in monitor.ps().tenants if t.name in names}
        if all(states.get(n) == "asleep" for n in names):
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"members did not fall asleep in {timeout_s:g} s: {states}")
        time.sleep(0.2)


def _states(url: str) -> dict[str, str]:
    """Each model's state from the fleet's ``/v1/models`` (empty if it does not answer)."""
    try:
        data = httpx.get(f"{url}/v1/models", timeout=5).json().get("data", [])
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    return {str(e.get("id")): str(e.get("state")) for e in data if isinstance(e, dict)}


def _direct(cluster: Cluster, waves: list[list[Member]], env: dict[str, str],
            monitor: Monitor, timeout_s: float) -> Launched:
    """The members as plain sleepable servers, one endpoint each, wave after wave."""
    procs: dict[str, Proc] = {}
    for i, group in enumerate(waves):
        for m in group:
            extra = ("--sleepable", "--sleep-after", repr(m.sleep_after_s), "--max-num-seqs",
                     str(m.max_num_seqs), "--block-size", str(m.block_size), "--device", "cpu")
            procs[m.name] = cluster.serve(m.name, m.checkpoint, m.kv_cache_size, True,
                                          extra=extra,
                                          env={**env, "KVPOOL_MAX": str(m.max_bytes)},
                                          weights="pool")
        cluster.wait_healthy(timeout_s)
        try:
            warm_up_all({m.name: procs[m.name].url or "" for m in group}, timeout_s)
        except httpx.HTTPError as e:
            raise ClusterError(f"a warm-up request failed: {e}") from None
        if i < len(waves) - 1:
            _sleep(monitor, group, timeout_s)
    return Launched({n: p.url for n, p in procs.items() if p.url is not None}, VIA_DIRECT,
                    cluster.workdir)
