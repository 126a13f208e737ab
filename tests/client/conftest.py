"""A real daemon subprocess (host backend, 64 KiB pages) for client-library tests."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = 64 << 10


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """The run directory of a running daemon (8 MiB budget), stopped afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvp-client-", dir="/tmp"))
    log = open(path.with_suffix(".log"), "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "daemon", "--backend", "host",
         "--run-dir", str(path), "--budget", "8MiB", "--page-size", str(PAGE)],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not ((path / "pages.sock").exists() and (path / "control.sock").exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"daemon did not start:\n{log.read()}")
            time.sleep(0.02)
        yield path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        path.with_suffix(".log").unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
