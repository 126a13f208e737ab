"""Helpers for the daemon tests: a handle on a daemon subprocess, worker I/O."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from kvpool import launch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
PAGE = 64 << 10


def daemon_command(run_dir: Path, *extra: str, budget: str | int | None = "8MiB",
                   page_size: int | None = PAGE, launcher: list[str] | None = None) -> list[str]:
    """The one command line every test starts a host-backend daemon with
    (:func:`kvpool.launch.daemon_argv` with the tests' budget and page size; ``budget`` or
    ``page_size`` None: left to the daemon's defaults; ``launcher`` replaces
    ``python -m kvpool.cli.main``, e.g. a fault-injecting wrapper)."""
    return launch.daemon_argv(run_dir, *extra, budget=budget, page_size=page_size,
                              launcher=launcher)


@dataclass
class DaemonProc:
    run_dir: Path
    proc: subprocess.Popen
    log: Path
    page_size: int
    workers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "kvpool.cli.main", *args, "--run-dir", str(self.run_dir)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO)
        if check and out.returncode != 0:
            raise AssertionError(f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def cli_json(self, *args: str):
        return json.loads(self.cli(*args, "--json").stdout)

    def monitor(self, timeout_s: float = 60.0):
        """A monitor session. Its requests wait up to ``timeout_s``: a test asserts what
        the daemon answers, not how fast a loaded machine lets it (latency is measured
        in benchmarks/)."""
        from kvpool.client_lib import Monitor

        return Monitor(self.run_dir, timeout_s=timeout_s)

    def connect(self, name: str, **kw):
        from kvpool.client_lib import connect

        return connect(name=name, run_dir=self.run_dir, **kw)

    def worker(self, *args: str) -> subprocess.Popen:
        cmd = [sys.executable, str(WORKER), *args, "--run-dir", str(self.run_dir)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO)
        self.workers.append(proc)
        return proc

    def check(self) -> list[str]:
        with self.monitor() as m:
            return m.check()

    def stats(self):
        with self.monitor() as m:
            return m.stats()

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


# what was read from a worker's stdout past its last whole line (read_line's own buffer)
_PENDING: weakref.WeakKeyDictionary[subprocess.Popen, bytearray] = weakref.WeakKeyDictionary()


def read_line(proc: subprocess.Popen, timeout: float = 30.0) -> str | None:
    """The next line a worker writes on stdout, waiting at most ``timeout`` seconds
    (AssertionError after; None at end of file). It polls the pipe (select) and reads
    what is there, never a readline that blocks past the deadline; every read of a
    worker's stdout goes through here (it keeps what follows the line for the next)."""
    assert proc.stdout is not None
    buf = _PENDING.setdefault(proc, bytearray())
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    while True:
        end = buf.find(b"\n")
        if end >= 0:
            line = bytes(buf[:end + 1])
            del buf[:end + 1]
            return line.decode(errors="replace")
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no line from worker pid {proc.pid} in {timeout} s")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:  # end of file: a last line without its newline, or none
            line, buf[:] = bytes(buf), b""
            return line.decode(errors="replace") if line else None
        buf += chunk


def read_event(proc: subprocess.Popen, event: str, timeout: float = 30.0) -> dict:
    """The next JSON line from a worker whose ``event`` is ``event``, within ``timeout``
    seconds whatever the worker does (AssertionError after)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = read_line(proc, max(0.0, deadline - time.monotonic()))
        except AssertionError:
            raise AssertionError(f"no {event!r} from worker in {timeout} s") from None
        if line is None:
            err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
            raise AssertionError(f"worker ended before {event!r}: rc={proc.poll()}\n{err}")
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("event") == event:
            return msg
        if msg.get("event") == "error":
            raise AssertionError(f"worker failed: {msg}")


def read_until(proc: subprocess.Popen, event: str, pred, timeout: float = 30.0) -> dict:
    """The first ``event`` line from a worker for which ``pred(msg)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {event!r} matching the condition in {timeout} s")
        msg = read_event(proc, event, timeout=left)
        if pred(msg):
            return msg


def spawn_daemon(cmd: list[str], run_dir: Path, log: Path, page_size: int = PAGE,
                 env: dict | None = None, append: bool = False, wait: bool = True) -> DaemonProc:
    """Start ``cmd`` (from :func:`daemon_command`) through :func:`kvpool.launch.spawn`,
    output to ``log`` (appended to with ``append``); with ``wait``, return once it serves
    (a daemon that does not is stopped and fails the test)."""
    started = launch.spawn(cmd, run_dir, log, env=env, cwd=REPO, append=append)
    d = DaemonProc(run_dir=run_dir, proc=started.popen, log=log, page_size=page_size)
    if wait:
        try:
            wait_ready(d)
        except AssertionError:
            stop_daemon(d)
            raise
    return d


def respawn(d: DaemonProc, timeout: float = 60.0) -> None:
    """Start ``d``'s command line again once it has exited (:func:`kvpool.launch.restart`:
    the dead daemon's socket files removed, its log appended to); ``d.proc`` becomes the
    new process, serving when this returns."""
    old = launch.DaemonProcess(d.run_dir, d.proc, list(d.proc.args), d.log, cwd=str(REPO))
    try:
        d.proc = launch.restart(old, timeout).popen
    except launch.DaemonStartError as e:
        raise AssertionError(str(e)) from None


def stop_daemon(d: DaemonProc) -> int:
    """SIGTERM, SIGKILL after 10 s (:func:`kvpool.launch.stop`); the exit status."""
    return launch.stop(d.proc)


def wait_ready(d: DaemonProc, timeout: float = 60.0) -> None:
    """Both daemon sockets exist (:func:`kvpool.launch.wait_serving`); a daemon that exits
    first, or does not serve in ``timeout``, fails the test with its log."""
    try:
        launch.wait_serving(d.proc, d.run_dir, d.log, timeout)
    except launch.DaemonStartError as e:
        raise AssertionError(str(e)) from None


def wait_for(pred, timeout: float = 30.0, every: float = 0.02, what: str = "condition"):
    """Poll ``pred`` every ``every`` s until it returns something truthy and return that;
    AssertionError naming ``what`` if it has not within ``timeout`` s (an outcome with a
    generous deadline, never a latency assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"{what} not reached in {timeout} s")
