"""scripts/gpu_check.sh on a CPU machine: the mechanics of the GPU check, without a GPU.

* a plain run exits 0, marks every GPU step SKIPPED and writes its summary;
* a smoke run (``GPU_CHECK_SMOKE=1``: the GPU steps' scripts on the host backend; here the
  vmm bench, the allocation bench and the daemon tenants) where one step hangs: that step is killed at its limit, what it left running is reaped, the later
  steps still run and pass, their JSON lands under ``$OUT/results`` (never in
  benchmarks/results/), and the run fails;
* on a machine that looks like a GPU machine but cannot run the CUDA backend, the GPU
  tests skip and that fails the run (``scripts/gpu_junit.py`` reads the JUnit XML);
* ``scripts/gpu_junit.py``: on a GPU machine a skipped GPU test fails the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
GPU_STEPS = ("pytest-gpu", "pytest-stub", "vmm-bench", "alloc-bench", "daemon", "engine-bench",
             "demo")
HANG_MARK = "4242.5"  # the hanging step leaves `sleep 4242.5` behind for the reaper


def run_check(out: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(out), "GPU_CHECK_FORCE_CPU": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout)


def steps(out: Path) -> dict[str, dict]:
    doc = json.loads((out / "summary.json").read_text())
    return {s["step"]: s for s in doc["steps"]}


def test_cpu_run_skips_every_gpu_step(tmp_path):
    out = tmp_path / "out"
    r = run_check(out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert "RESULT: PASS" in summary
    doc = json.loads((out / "summary.json").read_text())
    assert doc["gpu"] is False and doc["passed"] is True
    s = steps(out)
    assert s["setup"]["status"] == "ok" and s["diagnostics"]["status"] == "ok"
    for name in GPU_STEPS:
        assert s[name]["status"] == "SKIPPED" and s[name]["note"] == "no GPU", s[name]
        assert f"{name:<13} SKIPPED" in summary
    assert "probe():" in (out / "diagnostics.log").read_text()


def hanging_python(tmp_path: Path) -> Path:
    """An interpreter that hangs in vmm_bench.py (leaving a child behind) and is the real
    python everywhere else."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *benchmarks/vmm_bench.py*) setsid sleep {HANG_MARK} & exec sleep 600 ;;
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    return wrapper


def leftovers() -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().split(b"\0")[:2] == [b"sleep", HANG_MARK.encode()]:
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def test_smoke_run_survives_a_hanging_step(tmp_path):
    out = tmp_path / "out"
    results = REPO / "benchmarks" / "results"
    # what these scripts write there by default (other helpers' runs may add other files)
    defaults = [results / n for n in ("vmm_bench_host.json", "alloc_bench.json",
                                      "gpu_daemon_check_host.json")]

    def stamps() -> dict:
        return {p.name: p.stat().st_mtime_ns for p in defaults if p.exists()}

    before = stamps()
    r = run_check(out, GPU_CHECK_SMOKE="1", GPU_CHECK_PY=str(hanging_python(tmp_path)),
                  # the steps that must pass get room for a loaded machine (their own
                  # default limits are sized for an idle GPU host)
                  GPU_CHECK_TIMEOUTS="vmm-bench=5 diagnostics=400 alloc-bench=400 daemon=400",
                  GPU_CHECK_BUDGET="1600",
                  GPU_CHECK_STEPS="vmm-bench alloc-bench daemon")
    log = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 1, log
    s = steps(out)
    assert s["vmm-bench"]["status"] == "TIMEOUT", log
    for name in ("setup", "diagnostics", "alloc-bench", "daemon"):
        assert s[name]["status"] == "ok", (name, s[name], log)
    for name in ("pytest-gpu", "pytest-stub", "engine-bench", "demo"):
        assert s[name]["status"] == "SKIPPED" and s[name]["note"] == "not selected"
    summary = (out / "summary.txt").read_text()
    assert "RESULT: FAIL" in summary
    assert "daemon: grant_write pass, kill_frees_memory pass" in summary  # the figures
    deadline = time.monotonic() + 10
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftovers(), "the hanging step's child outlived the check"
    for name in ("alloc_bench_host", "gpu_daemon_check_host"):
        doc = json.loads((out / "results" / f"{name}.json").read_text())
        assert doc["backend"] == "host" and doc["command"].startswith("benchmarks/")
    assert json.loads((out / "results" / "gpu_daemon_check_host.json").read_text())["ok"]
    assert stamps() == before, "a smoke run wrote into benchmarks/results/"


def test_gpu_machine_whose_gpu_tests_skip_fails(tmp_path):
    """A machine that looks like it has a GPU (nvidia-smi lists one, torch says CUDA is
    available) but where the CUDA backend cannot run: the GPU tests skip, so the run fails."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    py = tmp_path / "python"
    py.write_text(f"""#!/usr/bin/env bash
case "$*" in *torch.cuda.is_available*) exit 0 ;; esac
exec {sys.executable} "$@"
""")
    py.chmod(0o755)
    out = tmp_path / "out"
    full = {**os.environ, "OUT": str(out), "PATH": f"{bindir}:{os.environ['PATH']}",
            "GPU_CHECK_PY": str(py), "GPU_CHECK_STEPS": "pytest-gpu"}
    full.pop("GPU_CHECK_FORCE_CPU", None)
    r = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=full, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["gpu"] is True and doc["passed"] is False
    step = steps(out)["pytest-gpu"]
    assert step["status"] == "FAIL" and "skipped on a machine with a GPU" in step["note"], step


def write_junit(path: Path, cases: list[str]) -> Path:
    body = "".join(f'<testcase classname="t" name="c{i}">{c}</testcase>'
                   for i, c in enumerate(cases))
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" '
                    f'errors="0" tests="{len(cases)}">{body}</testsuite></testsuites>')
    return path


@pytest.mark.parametrize("cases, gpu, ok", [
    (["", ""], True, True),
    (["", "<skipped/>"], True, False),  # a GPU test skipped on a GPU machine fails
    (["<skipped/>", "<skipped/>"], False, True),  # no GPU: skips are expected
    (["<skipped/>"], True, False),
    ([], True, False),  # nothing ran
    (["", "<failure/>"], False, False),
    (["<error/>"], False, False),
])
def test_junit_verdict(tmp_path, cases, gpu, ok):
    xml = write_junit(tmp_path / "r.xml", cases)
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_junit.py"), str(xml)] + (["--gpu"] if gpu else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    assert ("FAIL" in r.stdout) == (not ok)


def test_junit_unreadable_file_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_junit.py"),
                        str(tmp_path / "missing.xml")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
