"""Helpers for the arbitration tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from daemon.helpers import REPO, DaemonProc, wait_for  # noqa: F401  (wait_for re-exported)

WORKER = Path(__file__).with_name("worker.py")
# contend and idle workers import the bundled engine's pool (torch): seconds on a busy machine
READY_S = 180.0


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
