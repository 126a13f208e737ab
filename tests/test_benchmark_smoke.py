"""The benchmarks that drive the adapters through their Python API still run (a seam
change broke two of them silently once: ``enable`` now returns the bridge the engine is
built from). Each runs in its ``--quick`` mode and must write its JSON; the numbers are
the benchmark's business, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_elastic_overhead_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "eo.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "elastic_overhead_bench.py"),
                           "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {r["batch"] for r in doc["results"]} and all(
        r["elastic"]["n"] > 0 and r["static"]["n"] > 0 for r in doc["results"])


def test_train_colocate_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "tc.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_colocate_bench.py"),
                           "--cycles", "2", "--modes", "kvpool,sleep2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["modes"]) == {"kvpool", "sleep2"} and doc["check"] == {"kvpool": [],
                                                                          "sleep2": []}
    kv = doc["modes"]["kvpool"]  # published in place: no byte of weights copied
    assert kv["in_place"] is True and kv["weights_copied_per_step"] == 0
    assert doc["modes"]["sleep2"]["weights_copied_per_step"] > 0
    assert all(len(m["rss_after"]) == 2 and m["rss_after"][0]["engine"] > 0
               for m in doc["modes"].values())  # resident memory after every cycle
    assert out.with_suffix(".png").exists()


def test_switch_floor_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "sf.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "switch_floor_bench.py"),
                           "--sizes", "8MiB", "--page-sizes", "2MiB", "--backings", "shmem",
                           "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["size"], row["page_size"], row["backing"], row["check"]) == (
        8 << 20, 2 << 20, "shmem", [])
    assert all(len(v) == 1 for v in row["samples"].values())


def test_switch_floor_bench_refuses_bad_sizes(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "switch_floor_bench.py"),
                           "--sizes", "3MiB", "--page-sizes", "2MiB", "--out",
                           str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()
