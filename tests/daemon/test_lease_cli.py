"""Issue 34 item 6: ``kvpool lease``. A lease refused at once says its true cause (the
others' guaranteed memory and the weight sets in use leave too little; its shares
change nothing), never "at its fair share"; ``--min`` and ``--shares`` reach the
daemon (``--weight``, the old name, too, with one deprecation line; both together are
refused), bad values are one line and exit status 2 with nothing run; the job's input,
``KVPOOL_LEASE_BYTES``, is documented in the help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .helpers import PAGE, REPO

BUDGET = 16  # pages


def lease(d, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvpool.cli.main", "lease", "--run-dir", str(d.run_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_lease_refused_at_once_says_the_true_cause(start_daemon):
    d = start_daemon(budget=str(BUDGET * PAGE))
    with d.connect("srv", min=12 * PAGE) as srv:
        srv.region_group(1, 16 * PAGE).grant(range(12))
        out = lease(d, "--shares", "100", str(8 * PAGE), "--", "true")
    assert out.returncode == 1, out
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "fair share" not in err, err
    assert "srv 12" in err and "guaranteed" in err, err  # who holds the floor, how much
    assert "4 pages" in err, err  # what a lease could get here
    assert "whatever its shares" in err, err  # raising them changes nothing


@pytest.mark.parametrize("flag", ["--shares", "--weight"])
def test_min_and_shares_reach_the_daemon_and_the_job_gets_its_bytes(daemon, flag):
    """``--weight`` (the old name of ``--shares``) still works and says so in one line."""
    script = ("import os, subprocess, sys; print(os.environ['KVPOOL_LEASE_BYTES'], flush=True); "
              "subprocess.run([sys.executable, '-m', 'kvpool.cli.main', 'ps', '--json', "
              f"'--run-dir', {str(daemon.run_dir)!r}], check=True)")
    out = lease(daemon, "--name", f"job{flag}", "--min", "256KiB", flag, "2.5", "512KiB", "--",
                sys.executable, "-c", script)
    assert out.returncode == 0, out
    first, rest = out.stdout.split("\n", 1)
    assert int(first) == 512 << 10
    (job,) = [t for t in json.loads(rest)["tenants"] if t["name"] == f"job{flag}"]
    assert job["min"] == 256 << 10 and job["shares"] == 2.5 and job["lease"] == 512 << 10
    assert "weight" not in job and "share" not in job and "fair_share" in job
    said = [x for x in out.stderr.splitlines() if "deprecated" in x]
    assert said == ([] if flag == "--shares" else
                    ["kvpool: --weight is deprecated, use --shares (removed in the next "
                     "release)"]), out.stderr


def test_shares_and_weight_together_are_one_line_and_exit_2(daemon, tmp_path):
    marker = tmp_path / "ran"
    out = lease(daemon, "--shares", "2", "--weight", "3", "64KiB", "--", "touch", str(marker))
    assert out.returncode == 2, out
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--shares and --weight are both given" in err and "give --shares only" in err, err
    assert not marker.exists()


@pytest.mark.parametrize("args", [("--shares", "0"), ("--shares", "-1"), ("--shares", "nan"),
                                  ("--shares", "1e9"), ("--shares", "x"), ("--min", "lots"),
                                  ("--min", "-1MiB"), ("--min", "50%")])
def test_bad_min_or_shares_is_one_line_and_exit_2(daemon, tmp_path, args):
    marker = tmp_path / "ran"
    out = lease(daemon, *args, "64KiB", "--", "touch", str(marker))
    assert out.returncode == 2, out
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert args[0] in err, err
    assert not marker.exists()


def test_help_documents_the_jobs_input():
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "lease", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "KVPOOL_LEASE_BYTES" in text and "--min" in text and "--shares" in text
    assert "--weight" not in text  # (the old name: hidden)
