"""Issue 34 item 6: ``kvpool lease``. A lease refused at once says its true cause (the
others' guaranteed memory and the weight sets in use leave too little; its weight
changes nothing), never "at its fair share"; ``--min`` and ``--weight`` reach the
daemon, bad values are one line and exit status 2 with nothing run; the job's input,
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
        out = lease(d, "--weight", "100", str(8 * PAGE), "--", "true")
    assert out.returncode == 1, out
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "fair share" not in err, err
    assert "srv 12" in err and "guaranteed" in err, err  # who holds the floor, how much
    assert "4 pages" in err, err  # what a lease could get here
    assert "weight" in err, err  # raising it changes nothing


def test_min_and_weight_reach_the_daemon_and_the_job_gets_its_bytes(daemon):
    script = ("import os, subprocess, sys; print(os.environ['KVPOOL_LEASE_BYTES'], flush=True); "
              "subprocess.run([sys.executable, '-m', 'kvpool.cli.main', 'ps', '--json', "
              f"'--run-dir', {str(daemon.run_dir)!r}], check=True)")
    out = lease(daemon, "--name", "job", "--min", "256KiB", "--weight", "2.5", "512KiB", "--",
                sys.executable, "-c", script)
    assert out.returncode == 0, out
    first, rest = out.stdout.split("\n", 1)
    assert int(first) == 512 << 10
    (job,) = [t for t in json.loads(rest)["tenants"] if t["name"] == "job"]
    assert job["min"] == 256 << 10 and job["weight"] == 2.5 and job["lease"] == 512 << 10


@pytest.mark.parametrize("args", [("--weight", "0"), ("--weight", "-1"), ("--weight", "nan"),
                                  ("--weight", "1e9"), ("--weight", "x"), ("--min", "lots"),
                                  ("--min", "-1MiB"), ("--min", "50%")])
def test_bad_min_or_weight_is_one_line_and_exit_2(daemon, tmp_path, args):
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
    assert "KVPOOL_LEASE_BYTES" in text and "--min" in text and "--weight" in text
