"""`kvpool serve --elastic --handoff-from TENANT` as real processes: the new server finds
the running one through the daemon by its tenant name (the endpoint it registered,
``Locate``), takes its prefix cache over as pages and serves the repeated prompt with
cache hits; the old one is retired and the memory is accounted once. A name that cannot
be taken over (unknown, no endpoint, nothing listening, another process listening)
ends the new server with one line and a nonzero exit, the old one untouched."""

from __future__ import annotations

import httpx
import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.test_locate import endpoints_of as endpoints  # tenant -> endpoint (ps --json)
from kvpool import launch

from .test_pd_handoff import accounted
from .test_pd_serve import free_port
from .test_warm_serve import complete, serve


def test_a_new_server_takes_over_by_tenant_name(start_daemon, tiny_dir, tmp_path):
    d = start_daemon(budget="8MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log", tenant="tiny")
    first = complete(old_url, 130)
    assert endpoints(d) == {"tiny": old_url}  # the bridge registered where it serves
    new, url = serve(d, tiny_dir, tmp_path / "new.log", "--handoff-from", "tiny",
                     tenant="tiny-next")
    assert "tenant tiny (pid %d) serves at %s" % (old.pid, old_url) in (
        tmp_path / "new.log").read_text()
    # the old server is retired: no more requests, unhealthy
    assert httpx.get(f"{old_url}/health").status_code == 503
    r = httpx.post(f"{old_url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and "retired" in r.text
    # the new one hits the old one's cache, same tokens
    assert complete(url, 130) == first
    stats = httpx.get(f"{url}/v1/stats").json()
    assert stats["prefix_hit_tokens"] >= 128 - 16, stats["prefix_hit_tokens"]
    # both tenants are there, the memory is accounted once; `kvpool check` is clean
    assert sorted(accounted(d)) == ["tiny", "tiny-next"]
    assert endpoints(d) == {"tiny": old_url, "tiny-next": url}
    assert d.check() == [] and d.cli("check").returncode == 0
    old.terminate()
    old.wait(30)
    assert complete(url, 130) == first
    assert sorted(accounted(d)) == ["tiny-next"] and d.check() == []


def failed_start(d, tiny_dir, log, source: str) -> str:
    """Start a server taking over ``source``; it must exit nonzero. Its one-line error."""
    with pytest.raises(launch.ChildStartError, match="exited with code [1-9]"):
        serve(d, tiny_dir, log, "--handoff-from", source, tenant="tiny-next")
    text = log.read_text()
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, text
    return errors[0]


def test_a_name_that_cannot_be_taken_over_ends_the_new_server(start_daemon, tiny_dir,
                                                              tmp_path):
    d = start_daemon(budget="8MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log", tenant="tiny")
    first = complete(old_url, 130)
    with d.connect("bare"), d.connect("dead", endpoint=f"http://127.0.0.1:{free_port()}"), \
            d.connect("liar", endpoint=old_url):  # (this test's pid, not the server's)
        cases = {"ghost": "no tenant 'ghost' that may hand pages to 'tiny-next'",
                 "bare": "registered no endpoint", "dead": "nothing listens on port",
                 "liar": f"is served by pid {old.pid}, not by tenant 'liar'"}
        for source, why in cases.items():
            line = failed_start(d, tiny_dir, tmp_path / f"{source}.log", source)
            assert f"--handoff-from {source}: " in line and why in line, line
            assert "tiny-next" not in accounted(d)  # its tenant is gone, nothing adopted
    # the old server was never asked: it serves on, from its cache
    assert httpx.get(f"{old_url}/health").status_code == 200
    assert complete(old_url, 130) == first
    assert httpx.get(f"{old_url}/v1/stats").json()["prefix_hit_tokens"] >= 128 - 16
    assert sorted(accounted(d)) == ["tiny"] and d.check() == []
