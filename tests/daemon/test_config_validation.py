"""Issue 9 defect 10: every configuration value is validated once, at start.

Each bad value, given as a flag or in the TOML file, makes ``kvpool daemon`` exit with
status 2 and one ``Error: configuration:`` line per problem, never a traceback, and
before any socket exists.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvpool.daemon.config import Config, ConfigError

from .helpers import PAGE, REPO, DaemonProc, daemon_command, wait_ready


def start(run_dir: Path, *flags: str, toml: str | None = None,
          budget: str = "8MiB") -> subprocess.Popen:
    cmd = daemon_command(run_dir, *flags, budget=budget)
    if toml is not None:
        path = run_dir.with_suffix(".toml")
        path.write_text(toml)
        cmd += ["--config", str(path)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="kvp-cfg-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
    d.with_suffix(".toml").unlink(missing_ok=True)


def refused(proc: subprocess.Popen, run_dir: Path) -> list[str]:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        raise AssertionError(f"the daemon started (and served) instead of refusing:\n{err}")
    assert proc.returncode == 2, f"rc {proc.returncode}:\n{err}"
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("Error: configuration: ") for ln in lines), err
    assert not (run_dir / "pages.sock").exists() and not (run_dir / "control.sock").exists()
    return lines


@pytest.mark.parametrize("flags, needle", [
    (("--reclaim-timeout", "nan"), "--reclaim-timeout = nan"),
    (("--reclaim-timeout", "-1"), "--reclaim-timeout = -1"),
    (("--budget", "1000TiB"), "more than the device's"),
    (("--page-size", "0"), "--page-size = 0: must be more than 0"),
    (("--page-size", "3000"), "power of two"),
    (("--device", "-1"), "--device = -1"),
    (("--devices", "0,0"), "devices = '0,0': a device is named twice"),
    (("--devices", "0"), "devices = '0': no device to serve"),
    (("--devices", "one"), "--devices = 'one'"),
    (("--warm-min", "100GiB"), "warm_min = 100 GiB: more than the budget"),  # issue 33 #12
])
def test_bad_flags_are_refused(run_dir, flags, needle):
    budget = flags[1] if flags[0] == "--budget" else "8MiB"
    proc = start(run_dir, *[f for f in flags if flags[0] != "--budget"], budget=budget)
    (line,) = refused(proc, run_dir)
    assert needle in line


@pytest.mark.parametrize("toml, needle", [
    ("send_timeout_s = -1\n", "send_timeout_s = -1"),
    ("log_level = 5\n", "log_level = 5: expected str"),
    ('log_level = "chatty"\n', "expected one of DEBUG"),
    ('socket_mode = "rw-rw----"\n', "socket_mode"),
    ("socket_mode = 0o1777\n", "socket_mode = 1023"),
    ('liveness_s = "fast"\n', "liveness_s = 'fast': expected float"),
    ('device = "x"\n', "device = 'x': expected int"),
    ("max_sessions = 0\n", "max_sessions = 0"),
    ('[tenants.x]\nmin = "abc"\n', "tenants.x.min = 'abc': cannot parse size"),
    ("[tenants.x]\nshares = -3\n", "tenants.x.shares = -3"),
    ("[tenants.x]\nshares = 1\nweight = 2\n",
     "tenants.x: shares and weight are both given: weight is the old name of shares; give "
     "shares only"),
    ('[tenants.x]\nuids = ["root"]\n', "tenants.x.uids"),
    ('[tenants.x]\ncolour = "red"\n', "unknown keys colour"),
    ('[tenants.a]\nmin = "90%"\n[tenants.b]\nmin = "90%"\n', "add up to"),
    ('[tenants.a]\nmin = "60%"\nmax = "50%"\n', "above its max"),
    ("budgett = 5\n", "unknown configuration keys: budgett"),
    ('device_budgets = { "1" = "abc" }\n', "device 1: cannot parse size"),
    ('device_budgets = { "x" = "1MiB" }\n', "device_budgets"),
    ("budget = [\n", "not valid TOML"),
    ('warm_min = "200p"\n', "warm_min = '200p': more than the budget"),  # (128 pages)
])
def test_bad_config_values_are_refused(run_dir, toml, needle):
    lines = refused(start(run_dir, toml=toml), run_dir)
    assert any(needle in ln for ln in lines), lines


def test_every_problem_gets_its_own_line(run_dir):
    toml = 'send_timeout_s = -1\ndevice = "x"\n[tenants.x]\nmin = "abc"\nshares = 0\n'
    lines = refused(start(run_dir, "--reclaim-timeout", "nan", toml=toml), run_dir)
    assert len(lines) == 5, lines


def test_good_values_start_the_daemon(run_dir):
    """Positive control: octal strings for socket_mode, any-case log levels, page counts."""
    toml = ('socket_mode = "0640"\nlog_level = "debug"\nwarm_max = "4p"\n'
            '[tenants.a]\nmin = "25%"\nshares = 2\nuids = [0]\n')
    proc = start(run_dir, toml=toml)
    d = DaemonProc(run_dir=run_dir, proc=proc, log=run_dir / "none.log", page_size=PAGE)
    try:
        wait_ready(d)
        assert stat.S_IMODE(os.lstat(run_dir / "control.sock").st_mode) == 0o640
        with d.connect("a") as t:
            assert t.info.limit > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    assert proc.returncode == 0


def test_the_old_weight_key_still_works_with_one_line(run_dir):
    """``[tenants.NAME] weight``, the old name of ``shares``, is read as ``shares`` for one
    release; the daemon says so once, on stderr, before it serves."""
    toml = f'[tenants.a]\nweight = 3\nuids = [{os.getuid()}]\n'
    proc = start(run_dir, toml=toml)
    d = DaemonProc(run_dir=run_dir, proc=proc, log=run_dir / "none.log", page_size=PAGE)
    try:
        wait_ready(d)
        with d.connect("a") as t, d.monitor() as m:
            assert next(x for x in m.ps().tenants if x.id == t.id).shares == 3.0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert [x for x in err.splitlines() if "weight" in x] == [
        "kvpool: tenants.a.weight is deprecated, use shares (removed in the next release)"], err


def test_config_shares_and_the_old_weight(capsys):
    cfg = Config.from_dict({"tenants": {"a": {"weight": 2}, "b": {"shares": 5}}})
    assert (cfg.tenants["a"].shares, cfg.tenants["b"].shares) == (2.0, 5.0)
    assert capsys.readouterr().err == ("kvpool: tenants.a.weight is deprecated, use shares "
                                       "(removed in the next release)\n")
    given = {"a": {"weight": 2, "shares": 3}}
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"tenants": given})
    assert e.value.problems == ["tenants.a: shares and weight are both given: weight is the "
                                "old name of shares; give shares only"]
    assert given == {"a": {"weight": 2, "shares": 3}}  # (the caller's table is left alone)
    assert capsys.readouterr().err == ""


def ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))


def test_host_devices_share_one_ram_and_a_budget_that_cannot_hold_is_refused(run_dir):
    """Issue 33 item 12: ``--devices N`` on host simulates N devices in one RAM, so their
    budgets together must fit it: each device's budget is checked against its equal
    share, one line when it cannot hold."""
    third = ram_bytes() // 3  # fits RAM on one device; 4 of them do not
    (line,) = refused(start(run_dir, "--backend", "host", "--devices", "4",
                            budget=str(third)), run_dir)
    assert "budget = " in line and "4 devices" in line and "share" in line, line


def test_a_percentage_budget_is_split_between_host_devices(run_dir):
    """Issue 33 item 12: ``--devices 64 --budget 80%`` admitted ~51x RAM (each device 80%
    of it); now the 64 budgets add up to at most 80% of RAM."""
    proc = start(run_dir, "--backend", "host", "--devices", "64", budget="80%")
    d = DaemonProc(run_dir=run_dir, proc=proc, log=run_dir / "none.log", page_size=PAGE)
    try:
        wait_ready(d)
        from kvpool.client_lib import Monitor

        budgets = []
        for dev in range(64):
            with Monitor(run_dir, device=dev) as m:
                pool = m.ps().pool
                assert pool is not None and pool.device == dev
                budgets.append(pool.budget)
        assert min(budgets) > 0
        assert sum(budgets) <= ram_bytes() * 0.8, (sum(budgets), ram_bytes())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_config_schema_units():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"idle_work_s": math.inf, "recover_timeout_s": math.nan,
                          "warm_min": "16q", "default_max": "0%"})
    assert len(e.value.problems) == 4, e.value.problems
    cfg = Config.from_dict({"recover_timeout_s": 0, "budget": "50%", "socket_mode": "660"})
    assert cfg.recover_timeout_s == 0.0 and cfg.socket_mode == 0o660
    assert cfg.check_budget(total=64 * PAGE, page_size=PAGE) == 32 * PAGE
    with pytest.raises(ConfigError, match="less than one page"):
        Config.from_dict({"budget": PAGE - 1}).check_budget(total=64 * PAGE, page_size=PAGE)


def test_the_shipped_config_file_validates(monkeypatch):
    import kvpool.daemon.config_values as config_values

    monkeypatch.setattr(config_values, "group_exists", lambda name: True)  # the kvpool groups
    cfg = Config.load(REPO / "systemd" / "kvpool.toml")
    assert cfg.socket_group == "kvpool" and cfg.tenants["llama-8b"].shares == 2.0
    cfg.check_budget(total=80 << 30, page_size=2 << 20)
