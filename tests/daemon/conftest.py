"""Fixtures: a real daemon subprocess (host backend, small pages) and worker tenants."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from .helpers import (PAGE, DaemonProc, daemon_command, spawn_daemon, stop_daemon,
                      wait_ready)


LOG_TAIL = 12_000  # characters of each daemon's log a failed test report shows


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tail of each daemon it started (CI keeps no
    files: the log is the only witness of what the daemon was doing)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for d in getattr(item, "kvpool_daemons", ()):
            report.sections.append((f"daemon log {d.log.name}", d.logs()[-LOG_TAIL:]))


@pytest.fixture
def start_daemon(request):
    """``start_daemon(budget=..., page_size=..., extra=[...])`` -> :class:`DaemonProc`;
    ``launcher`` replaces ``python -m kvpool.cli.main`` (e.g. a fault-injecting wrapper)."""
    started: list[DaemonProc] = []
    request.node.kvpool_daemons = started  # shown when the test fails

    def start(budget: str = "8MiB", page_size: int = PAGE, extra: tuple[str, ...] = (),
              env: dict | None = None, launcher: list[str] | None = None) -> DaemonProc:
        run_dir = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
        cmd = daemon_command(run_dir, *extra, budget=budget, page_size=page_size,
                             launcher=launcher)
        d = spawn_daemon(cmd, run_dir, run_dir.with_suffix(".log"), page_size, env, wait=False)
        started.append(d)  # stopped and removed at the end even if it never serves
        wait_ready(d)
        return d

    yield start
    for d in started:
        for w in d.workers:
            if w.poll() is None:
                w.kill()
            w.wait()
            for stream in (w.stdout, w.stderr):
                if stream:
                    stream.close()
        stop_daemon(d)
        shutil.rmtree(d.run_dir, ignore_errors=True)
        d.log.unlink(missing_ok=True)


@pytest.fixture
def daemon(start_daemon) -> DaemonProc:
    return start_daemon()


@pytest.fixture
def make_arb():
    """Makes :class:`Arbiter` s over a 16-page host pool, without a daemon process:
    ``make_arb(cfg=None)`` (budget 16 pages unless ``cfg`` says otherwise).
    ``arb.register(name, kind, pid)`` opens a session (a socketpair stands in for the fd
    channel) and returns ``(tenant, identity, outcome of Register)``; ``arb.tenant(...)``
    does the same, asserts the registration, and returns ``(tenant, identity)``."""
    from kvpool import protocol as p
    from kvpool.daemon.arbiter import Arbiter
    from kvpool.daemon.config import Config
    from kvpool.daemon.pool import Pool
    from kvpool.vmm.host import HostBackend

    class ArbiterWithSessions(Arbiter):
        """The arbiter plus the two session helpers above."""

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.socks: list[socket.socket] = []

        def register(self, name: str, kind: str = "engine", pid: int | None = None):
            x, y = socket.socketpair()
            self.socks.extend((x, y))
            t = self.open_session(x, pid if pid is not None else 1000 + len(self.socks),
                                  0, 0, None)
            ident = name.encode()
            return t, ident, self.handle(ident, p.Register(id=1, token=t.token, name=name,
                                                           kind=kind))

        def tenant(self, name: str, kind: str = "engine", pid: int | None = None):
            t, ident, out = self.register(name, kind, pid)
            assert out.reply.ok, out.reply
            return t, ident

    made: list[tuple[ArbiterWithSessions, Pool, HostBackend]] = []

    def make(cfg: Config | None = None) -> ArbiterWithSessions:
        cfg = cfg or Config(budget=16 * PAGE)
        backend = HostBackend(page_size=PAGE)
        pool = Pool(backend, 16)
        a = ArbiterWithSessions(cfg, pool, 16 * PAGE)
        made.append((a, pool, backend))
        return a

    yield make
    for a, pool, backend in made:
        for s in a.socks:
            s.close()
        pool.close()
        backend.close()


@pytest.fixture
def arb(make_arb):
    """An :class:`Arbiter` over a 16-page host pool with the default config (see
    ``make_arb``)."""
    return make_arb()
