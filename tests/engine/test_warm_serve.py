"""`kvpool serve --elastic --handoff-from URL` as real processes: the new server takes the
running one's prefix cache over as pages, serves the repeated prompts with cache hits and
the same tokens; the old one is retired (refuses requests, /health 503) and the memory is
accounted once."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import REPO

from .test_pd_handoff import KV, accounted, prompt
from .test_pd_serve import body, free_port, healthy


def serve(d, model, log, *args: str, tenant: str = "tiny") -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
           "KVPOOL_RUN_DIR": str(d.run_dir), "KVPOOL_IDLE_TIMEOUT": "600",  # keep the cache
           "KVPOOL_TENANT": tenant, "PYTHONPATH": str(REPO)}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "serve", str(model), "--elastic",
             "--port", str(port), "--kv-cache-size", KV, "--served-model-name", "tiny",
             "--log-level", "warning", *args],
            stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    d.workers.append(proc)
    healthy(proc, f"http://127.0.0.1:{port}", log)
    return proc, f"http://127.0.0.1:{port}"


def complete(url: str, n: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json=body(n), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_new_server_takes_over_the_cache(start_daemon, tiny_dir, tmp_path):
    d = start_daemon(budget="8MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log")
    first = complete(old_url, 130)
    assert httpx.get(f"{old_url}/v1/stats").json()["prefix_hit_tokens"] == 0
    new, url = serve(d, tiny_dir, tmp_path / "new.log", "--handoff-from", old_url,
                     tenant="tiny-next")  # tenant names are unique while both run
    # the old server is retired: no more requests, unhealthy
    assert httpx.get(f"{old_url}/health").status_code == 503
    r = httpx.post(f"{old_url}/v1/completions", json=body(5), timeout=60)
    assert r.status_code == 400 and "retired" in r.text
    # the new one hits the old one's cache, same tokens
    assert complete(url, 130) == first
    stats = httpx.get(f"{url}/v1/stats").json()
    assert stats["prefix_hit_tokens"] >= 128 - 16, stats["prefix_hit_tokens"]
    # both tenants are there, the memory is accounted once
    assert sorted(accounted(d)) == ["tiny", "tiny-next"]
    assert d.check() == []
    old.terminate()
    old.wait(30)
    assert complete(url, 130) == first  # nothing of the new one's went with the old
    assert d.check() == []
