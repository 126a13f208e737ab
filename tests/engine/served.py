"""``kvpool serve`` of a checkpoint as a real subprocess for a test, through the project's
launcher (:mod:`kvpool.launch`): on a free port, until healthy, stopped after."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(model_dir: Path, log: Path, *args: str, timeout_s: float = 300) -> Iterator[str]:
    """``kvpool serve model_dir *args`` until healthy; yields its base URL. A server that
    exits or is not healthy within ``timeout_s`` fails the test with its log."""
    port = free_port()
    proc = launch.spawn_process([*launch.cli_argv(), "serve", str(model_dir), "--port",
                                 str(port), "--log-level", "warning", *args], log)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            launch.wait_healthy(proc, base, "kvpool serve", time.monotonic() + timeout_s,
                                logs=lambda: log.read_text())
        except launch.ChildStartError as e:
            pytest.fail(str(e))
        yield base
    finally:
        launch.stop(proc, grace_s=15)
