"""A fleet's life: its daemon (the running one, or one it starts), its members, its
endpoint; :func:`serve` runs it until SIGTERM or SIGINT.

Order: the listening socket is bound first (a port in use fails before anything
starts), then the daemon is found or started (``--with-daemon``: a fresh run directory
under /tmp, the ``[daemon]`` table's budget, page size and backend; its log
``daemon.log`` in the log folder), then the app serves (its lifespan starts the eager
members and the watch). ``fleet: serving N models on http://H:P`` goes to stderr once
the socket listens. On SIGTERM/SIGINT the ASGI server stops (open streams get
``GRACE_S``), the app's lifespan stops every member (process groups), and then the
daemon the fleet started is stopped and its run directory removed (also when the
daemon did not start).

A fleet killed with SIGKILL cannot clean up, so its children do not wait for it: the
daemon and every member are started with ``die_with_parent`` (the kernel SIGKILLs each
when the fleet dies; their own children follow them: a ``--pd`` prefill half has its
own death signal). The run directory it leaves is named for the fleet's pid
(``/tmp/kvpool-fleet-PID-*``); the next ``--with-daemon`` start removes every such
directory of this uid whose fleet is gone and whose daemon no longer answers
(:func:`sweep`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import httpx

from kvpool import control_token, launch, paths
from kvpool.fleet.admission import ModelQueue
from kvpool.fleet.balance import make_picker
from kvpool.fleet.entries import FleetConfig
from kvpool.fleet.engines import KINDS, MemberSpec
from kvpool.fleet.member import Member, free_port
from kvpool.fleet.metrics import FleetMetrics
from kvpool.fleet.policies import FLEET_POLICIES, PolicyError, Setup
from kvpool.fleet.endpoints_file import EndpointsFile, EndpointsFileError, advertised_address
from kvpool.fleet.router import create_app
from kvpool.fleet.router_protocol import FleetProtocol
from kvpool.fleet.supervisor import Supervisor

GRACE_S = 5  # open streams at shutdown
QUEUE_SLACK_S = 30.0  # a waiting request's deadline beyond start_timeout_s
#: what a vLLM member cannot do that a bundled one does (one line at start)
VLLM_LIMITS = ("its weights stay in its own memory, not in the pool (a sleep frees its "
               "KV cache alone, and no other member shares them)")


class FleetError(RuntimeError):
    """The fleet cannot start (no daemon, a port in use ...); one line."""


class _Stop(Exception):
    """SIGTERM or SIGINT outside the ASGI server's own handling."""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build(config: FleetConfig, run_dir: Path, log_dir: Path,
          log: Callable[[str], None] = say,
          ports: Callable[[], int] = free_port) -> tuple[Supervisor, dict[str, ModelQueue],
                                                        FleetMetrics, httpx.AsyncClient]:
    """The fleet's parts over the daemon of ``run_dir``; member logs in ``log_dir``;
    ``ports`` gives each member process its loopback port (:class:`Member`). The
    fleet's policy (``config.policy``) sets how its members start (their entries as the
    policy has them) and runs in the supervisor; one that cannot run is a
    :class:`FleetError`."""
    policy = FLEET_POLICIES.lookup(config.policy)
    entries = tuple(policy.member(e) for e in config.models)
    try:
        run = policy.start(config.policy_knobs, Setup(run_dir, config.daemon.backend,
                                                      config.name, entries, log))
    except PolicyError as why:
        raise FleetError(str(why)) from None
    metrics = FleetMetrics()
    # members are on loopback: no proxy from the environment, ever
    client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(10.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64))
    members: dict[str, list[Member]] = {}
    for e in entries:
        kind = KINDS.lookup(e.engine)
        members[e.name] = [
            Member(MemberSpec(e, e.tenant(i), config.name, run_dir, elastic=policy.elastic),
                   i, kind, log_dir / f"{e.tenant(i)}.log", ports)
            for i in range(e.replicas)]
        metrics.add_model(e.name, e.replicas)
        if e.engine == "vllm":  # what it cannot do, said once (docs/FLEET.md)
            log(f"fleet: {e.name} runs on vLLM: {VLLM_LIMITS}")
    try:  # the members inherit KVPOOL_CONTROL_TOKEN(_FILE): their /wake_up wants it
        control = control_token.headers(os.environ)
    except control_token.ControlTokenError as e:
        raise FleetError(str(e)) from None
    supervisor = Supervisor(members, metrics, client, config.start_timeout_s, log,
                            control_headers=control,
                            hung_after_s=config.hung_after_s,
                            hung_restart_s=config.hung_restart_s, policy=run)
    queues = {e.name: ModelQueue(e.name, members[e.name], supervisor, make_picker(e.routing),
                                 metrics, config.queue, config.start_timeout_s + QUEUE_SLACK_S)
              for e in entries}
    metrics.registry.register(FleetProtocol(queues))  # the router's names, its own queue
    return supervisor, queues, metrics, client


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise FleetError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise FleetError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def _raise_stop(sig: int, frame: FrameType | None) -> None:
    raise _Stop()


RUN_ROOT = Path("/tmp")  # short: a unix socket's path holds at most 107 bytes
RUN_PREFIX = "kvpool-fleet-"


def new_run_dir(root: Path = RUN_ROOT) -> Path:
    """A fresh private run directory for the fleet's own daemon, named for this process
    (``kvpool-fleet-PID-XXXXXXXX``) so a later start can tell whether its fleet lives."""
    return Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=root))


def sweep(root: Path = RUN_ROOT, say: Callable[[str], None] = say) -> list[Path]:
    """Remove the run directories that killed fleets left under ``root`` and return
    them. A directory is removed only when all of these hold: its name is
    ``kvpool-fleet-PID-*``, it is a directory (not a symlink) owned by this uid, no
    process ``PID`` exists, and nothing answers on its ``control.sock``. Anything else
    (another user's, a live fleet's, a name this fleet never makes) is left alone."""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for path in entries:
        rest = path.name[len(RUN_PREFIX):] if path.name.startswith(RUN_PREFIX) else ""
        pid, dash, _ = rest.partition("-")
        if not (dash and pid.isdigit() and 0 < int(pid) < 1 << 22):
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _alive(int(pid)) \
                or _answers(paths.control_path(path)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            say(f"fleet: removed {path}, left by a fleet that was killed (pid {pid})")
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _answers(sock_path: Path) -> bool:
    """Something accepts connections on the unix socket ``sock_path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(sock_path))
        except OSError:
            return False
    return True


def daemon_config(config: FleetConfig, folder: Path) -> Path | None:
    """The daemon config file the fleet's policy needs for the daemon it starts
    (``FleetPolicy.daemon_settings``: the baselines' ``reclaim_policy = "first_come"``),
    written to ``folder`` as ``daemon.toml``; None when it needs none."""
    settings = FLEET_POLICIES.lookup(config.policy).daemon_settings
    if not settings:
        return None
    path = folder / "daemon.toml"
    path.write_text(f"# the daemon of fleet {config.name!r} (policy {config.policy!r})\n"
                    + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    return path


def serve(config: FleetConfig, *, with_daemon: bool = False, host: str | None = None,
          port: int | None = None, log_dir: str | os.PathLike[str] | None = None,
          endpoints_file: str | os.PathLike[str] | None = None,
          endpoints_address: str | None = None,
          endpoints_namespace: str = "default") -> None:
    """Run the fleet until SIGTERM/SIGINT (see the module); raises :class:`FleetError`
    (one line) when it cannot start. ``endpoints_file``: keep a router's file-discovery
    list of this fleet's endpoints there (:mod:`kvpool.fleet.endpoints_file`; its
    address ``endpoints_address``, by default the one the fleet listens on)."""
    import uvicorn

    host = host or config.host
    port = config.port if port is None else port
    run_dir = paths.run_dir(None)
    if not with_daemon and not launch.serving(run_dir):
        raise FleetError(f"no kvpool daemon serves at {run_dir} (start one with `kvpool "
                         f"daemon`, set KVPOOL_RUN_DIR, or use --with-daemon)")
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"kvpool-fleet-"
                                                                       f"{config.name}-"))
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FleetError(f"cannot use the log folder {logs}: {e.strerror or e}") from None
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    sock = _listen(host, port)
    daemon: launch.DaemonProcess | None = None
    supervisor: Supervisor | None = None
    own_run_dir = False
    bound = sock.getsockname()
    endpoints: EndpointsFile | None = None
    try:
        if endpoints_file is not None:
            endpoints = EndpointsFile(Path(endpoints_file), config.name,
                                      advertised_address(host, endpoints_address),
                                      int(bound[1]), endpoints_namespace)
            try:  # a path it cannot write is one line before anything starts
                endpoints.update({e.name: "stopped" for e in config.models})
            except EndpointsFileError as e:
                raise FleetError(str(e)) from None
        if with_daemon:
            sweep()
            run_dir = new_run_dir()
            own_run_dir = True
            d = config.daemon
            try:
                daemon = launch.start_daemon(
                    run_dir, budget=d.budget, backend=d.backend, log=logs / "daemon.log",
                    page_size=None if d.page_size is None else int(d.page_size),
                    config=daemon_config(config, logs), new_session=True,
                    die_with_parent=True)
            except launch.DaemonStartError as e:
                raise FleetError(f"the fleet's daemon did not start: "
                                 f"{str(e).splitlines()[0]} (log {logs / 'daemon.log'})"
                                 ) from None
            say(f"fleet: started a daemon on run dir {run_dir} (log {logs / 'daemon.log'}); "
                f"see it with `kvpool ps --run-dir {run_dir}`")
        supervisor, queues, metrics, client = build(config, run_dir, logs)
        eager = list(dict.fromkeys(m.model for m in supervisor.all() if m.entry.eager))
        app = create_app(queues, supervisor, metrics, client, eager=eager,
                         endpoints=endpoints)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                               timeout_graceful_shutdown=GRACE_S))
        say(f"fleet: member logs in {logs}")
        say(f"fleet: serving {len(config.models)} models on http://{host}:{bound[1]} "
            f"(policy {config.policy})")
        asyncio.run(server.serve(sockets=[sock]))
    except _Stop:
        pass
    finally:
        if supervisor is not None:
            supervisor.stop_all()  # (the lifespan stopped them already, unless it never ran)
        sock.close()
        if daemon is not None:
            daemon.stop()
        if own_run_dir:  # (also when its daemon did not start)
            shutil.rmtree(run_dir, ignore_errors=True)
        if endpoints is not None:  # (the lifespan emptied it, unless it never ran)
            try:
                endpoints.close()
            except EndpointsFileError:
                pass
        for s, handler in previous.items():
            signal.signal(s, handler)
