"""The Grafana dashboard is what make_dashboard.py writes, and every metric it queries is
one the daemon exports (scraped from a real daemon with tenants) or the engine exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from daemon.helpers import REPO

from . import scenario
from .helpers import scrape

DASH = REPO / "deploy" / "grafana" / "kvpool.json"


def test_dashboard_is_generated_and_queries_exported_metrics(start_daemon, tmp_path):
    doc = json.loads(DASH.read_text())
    gen = subprocess.run([sys.executable, str(DASH.with_name("make_dashboard.py"))],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert json.loads(DASH.read_text()) == doc  # the committed JSON is up to date
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    assert len(doc["panels"]) >= 8 and len(exprs) >= 20
    titles = " ".join(p["title"] for p in doc["panels"])
    assert "Memory per tenant" in titles and "NO_MEMORY" in titles
    names = {n for e in exprs for n in re.findall(r"\b(?:kvpool|vllm)[:_][a-z_:]+", e)}
    d, port = scenario.start(start_daemon)
    job, _, _ = scenario.force_reclaim(d)  # the reclaim series exist
    exported = {name for name, _ in scrape(port)}
    engine_src = (REPO / "kvpool" / "engine" / "metrics.py").read_text()
    for name in names:
        base = re.sub(r"_(bucket|total)$", "", name)
        assert name in exported or f'"{base}"' in engine_src, name
    job.close()
