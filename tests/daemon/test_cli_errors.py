"""Issue 9 defect 12: the CLI says what happened, plainly and at once."""

from __future__ import annotations

import json
import signal

import pytest

from .helpers import PAGE


def test_limit_of_a_tenant_not_connected_says_so(daemon):
    out = daemon.cli("limit", "nosuch", "1MiB")
    assert out.stdout.strip() == ("no tenant named nosuch is connected: limit of nosuch set "
                                  "to 1 MiB, to apply when one registers")
    assert json.loads(daemon.cli("limit", "nosuch", "--shares", "2", "--json").stdout)[
        "connected"] == 0
    with daemon.connect("nosuch") as t:  # ... and it does apply when one registers
        assert t.limit == 1 << 20
        out = daemon.cli("limit", "nosuch", str(8 * PAGE))
        assert out.stdout.strip() == f"limit of nosuch set to {8 * PAGE >> 10} KiB"
        assert json.loads(daemon.cli("limit", "nosuch", "1MiB", "--json").stdout)[
            "connected"] == 1


def test_limit_shares_and_the_old_weight_flag(daemon):
    """``kvpool limit --shares``; ``--weight`` (its old name) still works for one release
    with one deprecation line on stderr; both together: one line, exit 2, no change."""
    with daemon.connect("knobs") as t:
        out = daemon.cli("limit", "knobs", "--shares", "3")
        assert out.stdout.strip() == "shares of knobs set to 3" and out.stderr == "", out
        out = daemon.cli("limit", "knobs", "--weight", "4")
        assert out.stdout.strip() == "shares of knobs set to 4", out
        assert out.stderr.splitlines() == [
            "kvpool: --weight is deprecated, use --shares (removed in the next release)"]
        out = daemon.cli("limit", "knobs", "--shares", "5", "--weight", "6", check=False)
        assert out.returncode == 2, out
        assert out.stderr.splitlines() == [
            "Error: --shares and --weight are both given: --weight is the old name of "
            "--shares; give --shares only"], out.stderr
        (shown,) = [x for x in daemon.cli_json("ps")["tenants"] if x["id"] == t.id]
        assert shown["shares"] == 4.0 and "weight" not in shown
        assert "--weight" not in daemon.cli("limit", "--help").stdout  # (hidden)


@pytest.mark.parametrize("size", ["0.5", "0.5B"])
def test_limit_refuses_a_fraction_of_a_byte_in_one_line(daemon, size):
    """Issue 33 item 12: ``kvpool limit t1 0.5`` set the limit to 0 bytes. Now: one
    line, exit 2, and the limit is what it was."""
    with daemon.connect("t1") as t:
        before = t.limit
        out = daemon.cli("limit", "t1", size, check=False)
        assert out.returncode == 2, out
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "fraction of a byte" in out.stderr and "Traceback" not in out.stderr
        (shown,) = [x for x in daemon.cli_json("ps")["tenants"] if x["name"] == "t1"]
        assert shown["max"] == before > 0


@pytest.mark.parametrize("args", [("ps",), ("check",), ("map",), ("stop",),
                                  ("limit", "x", "1MiB")])
def test_commands_against_a_dead_daemon_say_no_daemon(start_daemon, args):
    d = start_daemon()
    d.proc.send_signal(signal.SIGKILL)  # its sockets stay behind
    d.proc.wait()
    assert (d.run_dir / "control.sock").exists() and (d.run_dir / "pages.sock").exists()
    out = d.cli(*args, check=False)
    assert out.returncode == 1, out
    assert f"no kvpool daemon at {d.run_dir}" in out.stderr, out.stderr
    assert "BUSY" not in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_missing_run_dir_says_no_daemon(daemon, tmp_path):
    daemon.run_dir = tmp_path / "none"
    out = daemon.cli("ps", check=False)
    assert out.returncode == 1 and f"no kvpool daemon at {tmp_path / 'none'}" in out.stderr
