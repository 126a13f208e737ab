"""kvpool.launch, the one daemon launcher of tests, benchmarks and the demo: the command
line it builds, a real daemon it starts (serving when start returns) and stops, a daemon
that cannot start reported with its log, and a restart on the same run dir."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import launch
from kvpool.client_lib import Monitor

PAGE = 64 << 10


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvp-launch-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
    path.with_suffix(".log").unlink(missing_ok=True)


def test_the_command_line_is_launcher_daemon_flags_then_extra(run_dir):
    argv = launch.daemon_argv(run_dir, "--warm-max", "0", budget="8MiB", page_size=PAGE)
    assert argv == [sys.executable, "-P", "-m", "kvpool.cli.main", "daemon", "--backend", "host",
                    "--run-dir", str(run_dir), "--budget", "8MiB", "--page-size", str(PAGE),
                    "--warm-max", "0"]
    wrapped = launch.daemon_argv(run_dir, launcher=["setpriv", "--", "kvpool"], config="a.toml")
    assert wrapped == ["setpriv", "--", "kvpool", "daemon", "--backend", "host", "--run-dir",
                       str(run_dir), "--config", "a.toml"]  # no budget/page size: defaults


def test_a_started_daemon_serves_and_stops_cleanly(run_dir):
    log = run_dir.with_suffix(".log")
    d = launch.start_daemon(run_dir, budget=16 * PAGE, page_size=PAGE, log=log)
    try:
        assert launch.serving(run_dir)
        with Monitor(run_dir) as m:
            assert m.stats().pool.budget == 16 * PAGE
    finally:
        status = d.stop()
    assert status == 0, launch.log_tail(log)
    assert d.popen.poll() == 0  # reaped
    assert not launch.serving(run_dir)  # the clean stop removed its sockets


def test_a_daemon_that_cannot_start_is_reported_with_its_log(run_dir):
    log = run_dir.with_suffix(".log")
    with pytest.raises(launch.DaemonStartError) as e:
        launch.start_daemon(run_dir, budget="not-a-size", page_size=PAGE, log=log)
    assert "exited with code" in str(e.value)
    assert "not-a-size" in str(e.value)  # the daemon's own complaint, from the log


def test_a_killed_daemon_restarts_with_the_same_command_line(run_dir):
    log = run_dir.with_suffix(".log")
    d = launch.start_daemon(run_dir, "--warm-max", "0", budget=16 * PAGE, page_size=PAGE,
                            log=log)
    try:
        assert d.kill() == -9
        d = launch.restart(d)
        assert d.argv[-2:] == ["--warm-max", "0"]
        with Monitor(run_dir) as m:
            assert m.stats().pool.budget == 16 * PAGE
    finally:
        assert d.stop() == 0, launch.log_tail(log)


def test_the_serve_command_line_names_the_model_port_and_kv_size():
    argv = launch.serve_argv("/m", "--max-model-len", "512", port=8001, name="a",
                             kv_cache_size="4MiB", elastic=True)
    assert argv[:5] == [sys.executable, "-P", "-m", "kvpool.cli.main", "serve"]
    assert argv[5:] == ["/m", "--port", "8001", "--served-model-name", "a", "--kv-cache-size",
                        "4MiB", "--log-level", "warning", "--elastic", "--max-model-len", "512"]
    assert "--elastic" not in launch.serve_argv("/m", port=1, name="a", kv_cache_size=1)


def test_wait_healthy_returns_once_a_server_answers_and_reports_one_that_exits(tmp_path):
    import time

    from kvpool.demo.cluster import free_port

    (tmp_path / "health").write_text("ok")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = launch.spawn_process([sys.executable, "-m", "http.server", str(port), "--bind",
                                   "127.0.0.1", "--directory", str(tmp_path)],
                                  tmp_path / "server.log")
    try:
        launch.wait_healthy(server, url, "http.server", time.monotonic() + 60)
        assert launch.healthy(url)
    finally:
        launch.stop(server)
    assert not launch.healthy(url)
    gone = launch.spawn_process([sys.executable, "-c", "print('bye')"], tmp_path / "gone.log")
    with pytest.raises(launch.ChildStartError, match="exited with code 0"):
        launch.wait_healthy(gone, f"http://127.0.0.1:{free_port()}", "gone",
                            time.monotonic() + 60, lambda: "the log")
