"""Helpers for the policy attack tests: raw sessions that speak the protocol directly
(what a hostile client can send), page descriptors, and a daemon restart."""

from __future__ import annotations

import json
import os
import signal
import time

from kvpool import protocol as p
from kvpool.client_lib.connection import Connection
from kvpool.client_lib.errors import KvpoolError

from .helpers import DaemonProc, respawn


def session(d: DaemonProc, name: str | None = "attacker", kind: str = "engine",
            **register) -> Connection:
    """An fd-channel session, registered as ``name``/``kind`` unless ``name`` is None."""
    conn = Connection(d.run_dir, timeout_s=20)
    if name is not None:
        try:
            conn.call(p.Register(name=name, kind=kind, **register))
        except BaseException:
            conn.close()
            raise
    return conn


def code(fn) -> str:
    """The error code ``fn()`` fails with, or ``"ok"``."""
    try:
        fn()
    except KvpoolError as e:
        return e.code
    return "ok"


def memfds(n: int, size: int) -> list[int]:
    """``n`` page-like memfds (sealed against resizing, like the daemon's own)."""
    import fcntl

    out = []
    for _ in range(n):
        fd = os.memfd_create("kvpool-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        out.append(fd)
    return out


def adopt(conn: Connection, groups: list[p.AdoptGroup], fds: list[int], lease: int = 0,
          nfds: int | None = None) -> p.Reply:
    return conn.call(p.Adopt(groups=groups, lease=lease,
                             nfds=len(fds) if nfds is None else nfds), fds_ahead=fds)[0]


def saved_state(d: DaemonProc) -> tuple[set[int], int]:
    """(tenant pids, next group id) of the daemon's restart state."""
    try:
        state = json.loads((d.run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return set(), 0
    return {int(t["pid"]) for t in state.get("tenants", [])}, int(state.get("next_group", 0))


def restart(d: DaemonProc, expect_pid: int, next_group: int = 0, timeout: float = 20.0,
            between=None) -> None:
    """kill -9 the daemon once its restart state names ``expect_pid`` (and group ids up
    to ``next_group``), start it again with the same command line: the new one is
    recovering, waiting for that pid."""
    deadline = time.monotonic() + timeout
    while (lambda s: expect_pid not in s[0] or s[1] < next_group)(saved_state(d)):
        assert time.monotonic() < deadline, "the daemon never saved its restart state"
        time.sleep(0.02)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    if between is not None:  # e.g. edit the restart state the next daemon will read
        between()
    respawn(d)
    while True:  # until the new daemon answers
        try:
            stats(d)
            return
        except KvpoolError:
            assert d.proc.poll() is None, d.logs()
            assert time.monotonic() < deadline + timeout, "the restarted daemon never answered"
            time.sleep(0.05)


def stats(d: DaemonProc) -> p.StatsReply:
    with d.monitor() as m:
        return m.stats()
