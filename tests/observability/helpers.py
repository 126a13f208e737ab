"""Scraping ``/metrics`` with prometheus_client's own parser; tenants that answer reclaim."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpool.demo.cluster import free_port  # noqa: F401  (re-exported for the tests here)

WORKER = Path(__file__).resolve().parents[1] / "arbitration" / "worker.py"
REPO = Path(__file__).resolve().parents[2]


def scrape(port: int, path: str = "/metrics") -> dict[tuple[str, tuple], float]:
    """Every sample as ``{(name, sorted label items): value}``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def samples(metrics: dict, name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in metrics.items() if n == name}


def value(metrics: dict, name: str, **labels) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    got = [v for (n, ls), v in metrics.items()
           if n == name and all(dict(ls).get(k) == str(x) for k, x in labels.items())]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def spawn_idle(d, name: str, blocks: int) -> subprocess.Popen:
    """A tenant holding ``blocks`` 64 KiB blocks as cache, evicted by its shrink callback."""
    proc = subprocess.Popen([sys.executable, str(WORKER), "idle", "--name", name,
                             "--blocks", str(blocks), "--run-dir", str(d.run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    d.workers.append(proc)
    return proc
