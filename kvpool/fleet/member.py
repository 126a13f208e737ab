"""One replica of a fleet model: its server process and what the fleet knows of it.

States (``state``): ``stopped`` (no process: lazy and not asked for yet), ``starting``
(spawned, ``/health`` not yet 200), ``awake``, ``asleep`` (both answer requests: an
asleep one is woken first), ``hung`` (awake or asleep, but its server has answered no
look for a while: no request goes to it; killed and started again if it stays
silent), ``failed`` (did not start in time, or exited while starting; retried by a
request after ``FAILED_BACKOFF_S``).

Its port is chosen by the ``ports`` collaborator (:func:`free_port` by default: a port
the kernel had free a moment ago) and bound by the server later, so another process may
take it in between: :meth:`Member.port_taken` tells that exit (the server's last error
line says the address is in use, and names no other port), and
:meth:`Member.spawn_on_another_port` starts the same start again on a new port (the
supervisor does, up to ``PORT_TRIES`` processes per start). Until then the port may
answer for another server: :meth:`Member.another_listens` tells that ``/health``.

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
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

import psutil

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
PORT_TRIES = 3  # processes one start may take when each finds its port taken
#: an error line of a bind that found the address taken: uvicorn's (the bundled server:
#: ``[Errno 98] error while attempting to bind on address ('127.0.0.1', P): address
#: already in use``), vLLM's (``OSError: [Errno 98] Address already in use``), torch's
#: (``... name: EADDRINUSE ...``)
ADDRESS_IN_USE = re.compile(r"\[Errno (98|48)\]|\bEADDRINUSE\b|address already in use",
                            re.IGNORECASE)
#: a port an error line names: an address tuple's (``('127.0.0.1', 8000)``), ``port: N``
PORT_NAMED = re.compile(r"', (\d{1,5})\)|\bport\b[:= ]*(\d{1,5})\b", re.IGNORECASE)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def address_in_use(line: str, port: int) -> bool:
    """The error line ``line`` says a bind found its address in use, and names no port
    but ``port`` (one that names none is taken as the server's own: vLLM's)."""
    if not ADDRESS_IN_USE.search(line):
        return False
    named = {int(a or b) for a, b in PORT_NAMED.findall(line)}
    return not named or port in named


class Member:
    """One replica (see the module). ``spec`` says who it is, ``kind`` how its engine's
    server is started; ``log`` is where the server's output goes; ``ports`` gives the
    loopback port of each process (a port free now: the server binds it later)."""

    def __init__(self, spec: MemberSpec, index: int, kind: ServerKind, log: Path,
                 ports: Callable[[], int] = free_port) -> None:
        self.spec = spec
        self.entry = spec.entry
        self.model = spec.entry.name
        self.index = index
        self.tenant = spec.tenant
        self.kind = kind
        self.log = log
        self.ports = ports
        self.state: MemberState = STOPPED
        self.popen: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.port = 0  # the current process's
        self.started_at = 0.0  # monotonic, of the current process
        self.up_at = 0.0  # monotonic: when the current process was first seen healthy
        self.answered_at = 0.0  # monotonic: the last look its server answered
        self.failed_at = 0.0
        self.last_error = ""
        self.log_from = 0  # the log's size when the current process started
        self.starts = 0
        self.port_tries = 0  # processes the current start took (another: its port was taken)
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
        """Start the server on a fresh loopback port (one start more; the supervisor
        makes it ``starting``)."""
        self._launch()
        self.starts += 1
        self.port_tries = 1
        self.sleeps_seen, self.wakes_seen = {}, 0
        self.kv = None

    def spawn_on_another_port(self) -> None:
        """The current start again, its server on a new port: the last process found
        its port taken (:meth:`port_taken`) and never served. Not a start more."""
        self._launch()
        self.port_tries += 1

    def _launch(self) -> None:
        port = self.ports()
        how = self.kind.launch(self.spec, port)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        self.popen = launch.spawn_process(how.argv, self.log, new_session=True, append=True,
                                          base_env=how.env, die_with_parent=True)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.started_at = self.answered_at = self.up_at = time.monotonic()

    def another_listens(self) -> bool:
        """Another process's server listens on this member's port (one this user can
        see, outside the server's process tree): a ``/health`` 200 there is not this
        member's, whose server will exit with :meth:`port_taken`. False when it cannot
        be told (a listener of another uid, no process). Reads every socket: a thread."""
        if self.popen is None:
            return False
        try:
            pids = {c.pid for c in psutil.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port}
            server = psutil.Process(self.popen.pid)
            ours = {server.pid, *(p.pid for p in server.children(recursive=True))}
        except psutil.Error:
            return False
        return bool(pids) and None not in pids and not pids & ours

    def port_taken(self, code: int) -> bool:
        """The process, exited with status ``code``, could not bind its port: another
        process had taken it (an exit code, and its last error line says the address
        is in use: :func:`address_in_use`). Any other exit is not."""
        return code > 0 and address_in_use(self.last_error_line(), self.port)

    def exit_code(self) -> int | None:
        """The process's exit status once it has exited (None: running, or none)."""
        return None if self.popen is None else self.popen.poll()

    def fail(self, why: str) -> None:
        """Did not start: when and why (the supervisor makes it ``failed``; the process,
        if any, is killed: call :meth:`stop` on a thread after this when it may still
        run)."""
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
