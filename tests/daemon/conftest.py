"""Fixtures: a real daemon subprocess (host backend, small pages) and worker tenants."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from .helpers import PAGE, REPO, DaemonProc, daemon_command, wait_ready


@pytest.fixture
def start_daemon():
    """``start_daemon(budget=..., page_size=..., extra=[...])`` -> :class:`DaemonProc`;
    ``launcher`` replaces ``python -m kvpool.cli.main`` (e.g. a fault-injecting wrapper)."""
    started: list[DaemonProc] = []

    def start(budget: str = "8MiB", page_size: int = PAGE, extra: tuple[str, ...] = (),
              env: dict | None = None, launcher: list[str] | None = None) -> DaemonProc:
        run_dir = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
        log = run_dir.with_suffix(".log")
        cmd = daemon_command(run_dir, *extra, budget=budget, page_size=page_size,
                             launcher=launcher)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, **(env or {})})
        d = DaemonProc(run_dir=run_dir, proc=proc, log=log, page_size=page_size)
        started.append(d)
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
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            try:
                d.proc.wait(10)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
        shutil.rmtree(d.run_dir, ignore_errors=True)
        d.log.unlink(missing_ok=True)


@pytest.fixture
def daemon(start_daemon) -> DaemonProc:
    return start_daemon()
