"""The main job end to end (short), its workload generator, and its bad-input errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import psutil

from click.testing import CliRunner

from kvpool.cli.main import cli
from kvpool.demo import workload
from kvpool.demo.workload import WorkloadShape, generate


def test_workload_is_seeded_and_takes_turns(monkeypatch):
    shape = WorkloadShape(models=["a", "b", "c"], duration_s=30, phase_s=5, base_rate=0.2,
                          peak_rate=6, seed=3)
    first, again = generate(shape), generate(shape)
    assert first == again and first == sorted(first, key=lambda a: a.at)
    in_turn = [a for a in first if int(a.at // 5) % 3 == ["a", "b", "c"].index(a.model)]
    assert len(in_turn) > 0.7 * len(first)  # most requests come from the peaking model
    for a in first:
        assert 16 <= a.prompt_len <= 384 and 8 <= a.max_tokens <= 64
    monkeypatch.setattr(workload, "trace_dir", lambda: None)  # a clone without shared/
    assert len(generate(shape)) == len(first)  # synthetic lengths, same arrivals


def test_demo_rejects_bad_sizes():
    r = CliRunner().invoke(cli, ["demo", "--budget", "lots"])
    assert r.exit_code != 0 and "cannot parse size" in r.output


def test_demo_runs_to_completion(tmp_path):
    """Both modes, real daemon and servers, a few seconds of load: table, chart, JSON."""
    out = tmp_path / "demo"
    mark = uuid.uuid4().hex  # inherited by every process the demo starts
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "demo", "--out", str(out), "--duration", "4",
         "--peak-rate", "3", "--base-rate", "0.5", "--no-live"],
        capture_output=True, text=True, timeout=240, env={**os.environ, MARK: mark})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "results.json").read_text())
    for mode in ("static", "elastic"):
        s = result["summary"][mode]["all"]
        assert s["requests"] > 0 and s["finished"] == s["requests"] and s["errors"] == 0
    assert (out / "memory.png").stat().st_size > 1000
    assert "p99 TTFT" in proc.stdout
    tail = result["summary"]["elastic"]["all"]["p99_tail"]  # from the daemon's event stream
    assert tail["events"] > 0 and tail["requests"] >= 1 and "p99 TTFT tail" in proc.stdout
    assert abs(tail["reclaim_wait_s"] + tail["compute_queue_s"] - tail["ttft_s"]) < 1e-6
    assert (out / "logs" / "elastic" / "daemon.log").exists()  # it did start a daemon
    left = marked(mark)
    for _, p in left:  # do not leak them into other tests
        p.kill()
    assert not left, f"the demo left processes behind: {[c for c, _ in left]}"


MARK = "KVPOOL_TEST_DEMO_MARK"


def marked(mark: str) -> list[tuple[str, psutil.Process]]:
    """Live processes whose environment carries ``MARK=mark`` (the demo's descendants,
    wherever they were reparented, whatever their command line)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append((" ".join(p.cmdline()), p))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found
