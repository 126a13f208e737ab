"""One replica of a fleet model: its server process and what the fleet knows of it.

States (``state``): ``stopped`` (no process: lazy and not asked for yet), ``starting``
(spawned, ``/health`` not yet 200), ``awake``, ``asleep`` (both answer requests: an
asleep one is woken first), ``hung`` (awake or asleep, but its server has answered no
look for a while: no request goes to it; killed and started again if it stays
silent), ``failed`` (did not start in time, or exited while starting; retried by a
request after ``FAILED_BACKOFF_S``).

The process runs in a session of its own (its process group is signalled: the server
and anything it started, a ``--pd`` child say, stop together) and writes to its log in
the fleet's log folder (appended to across restarts). Only the fleet's event loop
changes a member; :meth:`stop` blocks for up to its grace time (call it on a thread).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Final, Literal

from kvpool import launch
from kvpool.fleet.balance import ReplicaLoad
from kvpool.fleet.engines import MemberSpec, ServerKind
from kvpool.fleet.router_protocol import MemberKV

MemberState = Literal["stopped", "starting", "awake", "asleep", "hung", "failed"]  # (above)
STOPPED: Final = "stopped"
STARTING: Final = "starting"
AWAKE: Final = "awake"
ASLEEP: Final = "asleep"
HUNG: Final = "hung"
FAILED: Final = "failed"
READY: tuple[MemberState, ...] = (AWAKE, ASLEEP)
# a process that served: looked at, restarted if it dies
WATCHED: tuple[MemberState, ...] = (AWAKE, ASLEEP, HUNG)
FAILED_BACKOFF_S = 10.0  # a failed member is started again by a request after this long
STOP_GRACE_S = 10.0
#: a log line that says what went wrong: an exception's line (``ValueError: ...``,
#: ``RuntimeError: ...``), a ``kvpool:`` refusal, a logger's ERROR/CRITICAL line
ERROR_LINE = re.compile(r"(\b[A-Za-z_.]*(Error|Exception|Exit)\b:?|^kvpool: |\b(ERROR|CRITICAL|"
                        r"FATAL)\b)")
#: a warning (Python's, a logger's): never the reason a server died
WARNING_LINE = re.compile(r"(Warning\b|\bWARNING\b|\bwarnings\.warn)")
READ_BACK = 64 << 10  # bytes of the end of a log read for the last error line


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class Member:
    """One replica (see the module). ``spec`` says who it is, ``kind`` how its engine's
    server is started; ``log`` is where the server's output goes."""

    def __init__(self, spec: MemberSpec, index: int, kind: ServerKind, log: Path) -> None:
        self.spec = spec
        self.entry = spec.entry
        self.model = spec.entry.name
        self.index = index
        self.tenant = spec.tenant
        self.kind = kind
        self.log = log
        self.state: MemberState = STOPPED
        self.popen: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.started_at = 0.0  # monotonic, of the current process
        self.up_at = 0.0  # monotonic: when the current process was first seen healthy
        self.answered_at = 0.0  # monotonic: the last look its server answered
        self.failed_at = 0.0
        self.last_error = ""
        self.log_from = 0  # the log's size when the current process started
        self.starts = 0
        self.inflight = 0  # requests the router sent it that have not finished
        self.completed = 0  # requests the router sent it that have finished (however)
        self.idle_since = time.monotonic()  # when its last request finished
        # what the server counted when last observed (a restart starts from zero)
        self.sleeps_seen: dict[str, int] = {}
        self.wakes_seen = 0
        self.counts_wakes = False  # the server counts its wakes (its last look said)
        self.kv: MemberKV | None = None  # its KV as its server last said (stats_path)

    @property
    def ready(self) -> bool:
        return self.state in READY

    def load(self, awake_only: bool) -> ReplicaLoad:
        """This replica for a picker; ``awake_only``: an asleep one counts as not ready
        (the router prefers an awake replica to waking one)."""
        ready = self.state == AWAKE if awake_only else self.ready
        return ReplicaLoad(index=self.index, inflight=self.inflight,
                           capacity=self.entry.max_num_seqs, ready=ready)

    def startable(self, now: float) -> bool:
        """Stopped, or failed long enough ago to try again."""
        return self.state == STOPPED or (self.state == FAILED
                                         and now - self.failed_at >= FAILED_BACKOFF_S)

    def spawn(self) -> None:
        """Start the server on a fresh loopback port: ``starting``."""
        port = free_port()
        how = self.kind.launch(self.spec, port)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        self.popen = launch.spawn_process(how.argv, self.log, new_session=True, append=True,
                                          base_env=how.env, die_with_parent=True)
        self.url = f"http://127.0.0.1:{port}"
        self.state = STARTING
        self.started_at = self.answered_at = self.up_at = time.monotonic()
        self.starts += 1
        self.sleeps_seen, self.wakes_seen = {}, 0
        self.kv = None

    def exit_code(self) -> int | None:
        """The process's exit status once it has exited (None: running, or none)."""
        return None if self.popen is None else self.popen.poll()

    def fail(self, why: str) -> None:
        """Did not start: ``failed`` (the process, if any, is killed: call :meth:`stop`
        on a thread after this when it may still run)."""
        self.state = FAILED
        self.failed_at = time.monotonic()
        self.last_error = why

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; reaped. Blocks."""
        if self.popen is not None:
            launch.stop(self.popen, grace_s, group=True)

    def log_tail(self, lines: int = 1) -> str:
        """The last non-empty lines of the server's log (why it died)."""
        tail = [x for x in launch.log_tail(self.log, 40).splitlines() if x.strip()]
        return " | ".join(tail[-lines:])[:300]

    def why_exited(self, code: int) -> str:
        """Why the process exited with status ``code``, in one line: the signal that
        killed it, else the exit code and the last error line the process wrote
        (:data:`ERROR_LINE`, never a warning; none found: the code alone)."""
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name}"
        line = self.last_error_line()
        return f"exited with code {code}" + (f": {line}" if line else "")

    def last_error_line(self) -> str:
        """The last line of the current process's log that says what went wrong ('')."""
        try:
            with open(self.log, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = max(self.log_from, size - READ_BACK)
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        for line in reversed(text.splitlines()):
            line = line.strip()
            if line and ERROR_LINE.search(line) and not WARNING_LINE.search(line) \
                    and not line.startswith(("File ", "Traceback ")):
                return line[:300]
        return ""

    def kill(self) -> None:
        """SIGKILL the process group (a hung server: a stopped one ignores SIGTERM) and
        reap the server. Blocks until reaped (call it on a thread)."""
        if self.popen is not None:
            self.kill_group()
            self.popen.wait()

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the process group of a server that exited (a
        child it started); nothing when the group is gone."""
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
