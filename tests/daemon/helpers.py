"""Helpers for the daemon tests: a handle on a daemon subprocess, worker I/O."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
PAGE = 64 << 10


def daemon_command(run_dir: Path, *extra: str, budget: str | int | None = "8MiB",
                   page_size: int | None = PAGE, launcher: list[str] | None = None) -> list[str]:
    """The one command line every test starts a host-backend daemon with (``budget`` or
    ``page_size`` None: left to the daemon's defaults; ``launcher`` replaces
    ``python -m kvpool.cli.main``, e.g. a fault-injecting wrapper)."""
    cmd = [*(launcher or [sys.executable, "-m", "kvpool.cli.main"]), "daemon",
           "--backend", "host", "--run-dir", str(run_dir)]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    if page_size is not None:
        cmd += ["--page-size", str(page_size)]
    return [*cmd, *extra]


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

    def monitor(self):
        from kvpool.client_lib import Monitor

        return Monitor(self.run_dir)

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


def read_event(proc: subprocess.Popen, event: str, timeout: float = 30.0) -> dict:
    """The next JSON line from a worker whose ``event`` is ``event``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.poll() is not None else ""
            raise AssertionError(f"worker ended before {event!r}: rc={proc.poll()}\n{err}")
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("event") == event:
            return msg
        if msg.get("event") == "error":
            raise AssertionError(f"worker failed: {msg}")
    raise AssertionError(f"no {event!r} from worker in {timeout} s")


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


def wait_ready(d: DaemonProc, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {d.proc.returncode}:\n{d.logs()}")
        if (d.run_dir / "pages.sock").exists() and (d.run_dir / "control.sock").exists():
            return
        time.sleep(0.02)
    raise AssertionError(f"daemon not ready in {timeout} s:\n{d.logs()}")
