"""A real daemon subprocess (host backend, 64 KiB pages) for client-library tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import launch

REPO = Path(__file__).resolve().parents[2]
PAGE = 64 << 10


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """The run directory of a running daemon (8 MiB budget), stopped afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvp-client-", dir="/tmp"))
    log = path.with_suffix(".log")
    try:
        with launch.start_daemon(path, budget="8MiB", page_size=PAGE, log=log, cwd=REPO):
            yield path
    finally:
        log.unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
