"""The daemon's /metrics, scraped with prometheus_client's own parser while real tenants
run: per-tenant and pool gauges equal ``kvpool ps --json`` at the same moment, counters
only grow, and a lease that forces a reclaim shows in the reclaim counters and histograms."""

from __future__ import annotations

import subprocess
import time

from daemon.helpers import PAGE, REPO, daemon_command

from . import scenario
from .helpers import samples, scrape, value

TENANT_KEYS = ("mapped", "in_use", "reserve", "lease", "fair_share", "min", "max", "asked",
               "waiting")
POOL_KEYS = ("budget", "granted", "warm", "dirty", "leased", "free", "waiting", "retained")
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def gauges(m: dict) -> dict:
    return {k: v for k, v in m.items() if k[0].startswith(("kvpool_tenant_", "kvpool_pool_"))
            and not k[0].endswith("_total")}


def same_moment(d, port, deadline_s: float = 30.0):
    """A scrape and a ``ps --json`` of the same state: scrape, ps, scrape until the two
    scrapes agree (nothing changed in between, so ps saw that state too)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        m1 = scrape(port)
        ps = d.cli_json("ps")
        m2 = scrape(port)
        if gauges(m1) == gauges(m2):
            return m2, ps
    raise AssertionError("the daemon's state never held still for a scrape")


def assert_matches_ps(m: dict, ps: dict) -> None:
    tenants = ps["tenants"]
    assert {t["name"] for t in tenants} >= {"alpha", "beta"}
    assert len(samples(m, "kvpool_tenant_mapped_bytes")) == len(tenants)
    for t in tenants:
        ids = {"tenant": t["name"], "tenant_id": t["id"]}
        for key in TENANT_KEYS:
            assert value(m, f"kvpool_tenant_{key}_bytes", **ids) == t[key], (t["name"], key)
        assert value(m, "kvpool_tenant_shares", **ids) == t["shares"]
        state = "unresponsive" if t["unresponsive"] else "waiting" if t["waiting"] else \
            "asked" if t["asked"] else "ok"
        assert value(m, "kvpool_tenant_state", state=state, **ids) == 1
        assert value(m, "kvpool_tenant_asleep", **ids) == (t["state"] == "asleep")
        assert value(m, "kvpool_tenant_sleepable", **ids) == t["sleepable"]
    for key in POOL_KEYS:
        assert value(m, f"kvpool_pool_{key}_bytes", device=0) == ps["pool"][key], key


def assert_grew(before: dict, after: dict) -> None:
    """Every counter sample of ``before`` is in ``after`` and no smaller (a departed
    tenant's own series go with it, as Prometheus series do)."""
    live = {dict(ls).get("tenant_id") for _, ls in after}
    counters = [k for k in before if k[0].endswith(COUNTER_SUFFIXES)
                and dict(k[1]).get("tenant_id") in live]
    assert len(counters) > 40
    for k in counters:
        assert k in after and after[k] >= before[k], (k, before[k], after.get(k))


def test_gauges_equal_ps_counters_grow_and_a_lease_shows_in_reclaim(start_daemon):
    d, port = scenario.start(start_daemon)
    m, ps = same_moment(d, port)
    assert_matches_ps(m, ps)
    assert value(m, "kvpool_tenant_mapped_bytes", tenant="alpha") >= 10 * PAGE
    before = scrape(port)
    rounds = value(before, "kvpool_reclaim_rounds_total")

    job, nbytes, free = scenario.force_reclaim(d)
    after = scrape(port)
    assert_grew(before, after)
    assert value(after, "kvpool_reclaim_rounds_total") >= rounds + 1
    assert value(after, "kvpool_reclaim_round_seconds_count") >= 1
    assert value(after, "kvpool_grant_wait_seconds_count") >= 1
    assert value(after, "kvpool_leases_total") >= 1
    assert value(after, "kvpool_waits_total") >= 1
    shrink = value(after, "kvpool_reclaim_asks_total", mode="shrink") + \
        value(after, "kvpool_reclaim_asks_total", mode="reserve")
    assert shrink >= 1
    reclaimed = sum(samples(after, "kvpool_reclaimed_bytes_total").values())
    assert reclaimed >= nbytes - free
    assert value(after, "kvpool_tenant_lease_bytes", tenant="job") == nbytes
    stages = samples(after, "kvpool_reclaim_rounds_by_stage_total")
    assert sum(stages.values()) >= 1

    m, ps = same_moment(d, port)  # still equal to ps with the lease held
    assert_matches_ps(m, ps)
    job.close()
    final = scrape(port)
    assert_grew(after, final)


def test_a_dead_tenant_and_a_refused_grant_are_counted(start_daemon):
    d, port = scenario.start(start_daemon)
    before = scrape(port)
    victim = d.workers[0]
    victim.kill()
    victim.wait()
    deadline = time.monotonic() + 30
    while value(scrape(port), "kvpool_tenant_departures_total", how="death") < 1:
        assert time.monotonic() < deadline, "the death was not counted"
        time.sleep(0.05)
    t = d.connect("greedy")
    g = t.region_group(1, 64 * PAGE)
    try:
        g.grant(range(40))  # past the budget (32 pages): NO_MEMORY or OVER_LIMIT
    except Exception:
        pass
    after = scrape(port)
    assert_grew(before, after)
    assert value(after, "kvpool_tenant_memory_return_seconds_count") >= 1
    refused = value(after, "kvpool_answers_total", code="OVER_LIMIT") + \
        value(after, "kvpool_answers_total", code="NO_MEMORY")
    assert refused >= 1
    t.close()


def test_a_non_loopback_metrics_address_is_refused(tmp_path):
    out = subprocess.run(
        daemon_command(tmp_path / "run", "--metrics-address", "192.0.2.1:9400", budget="1MiB"),
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode != 0
    assert "not loopback" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
