"""Helpers for the arbitration tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from daemon.helpers import REPO, DaemonProc

WORKER = Path(__file__).with_name("worker.py")


def spawn(d: DaemonProc, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """A worker tenant of ``d`` (killed by the daemon fixture at the end)."""
    cmd = [*prefix, sys.executable, str(WORKER), *args, "--run-dir", str(d.run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    d.workers.append(proc)
    return proc


def mapped(d: DaemonProc) -> dict[str, int]:
    with d.monitor() as m:
        return {t.name: t.mapped for t in m.ps().tenants}


def wait_for(pred, timeout: float, every: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"{what} not reached in {timeout} s")
