"""A flood of /metrics scrapes while an honest tenant grants (issue 24, defect 3): what the
scrapes cost the daemon's event loop is bounded whatever their rate — the loop builds at
most one snapshot per ``metrics.MIN_INTERVAL_S`` (counted: ``kvpool_snapshots_built``),
not one per scrape — and every scrape still gets a snapshot newer than itself.

No latency is asserted (latencies belong in ``benchmarks/alloc_bench.py --metrics
--flood``): the test counts the loop's work."""

from __future__ import annotations

import threading
import time
import urllib.request

from daemon.helpers import PAGE
from kvpool.daemon.metrics import MIN_INTERVAL_S

from .helpers import free_port, scrape, value

FLOODERS = 6
GRANTS = 150


def flood(port: int, stop: threading.Event, count: list[int], on: threading.Event) -> None:
    while not stop.is_set():
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
            count[0] += 1
            on.set()
        except OSError:
            count[1] += 1  # refused (backlog full) or timed out: the flood's problem


def test_a_scrape_flood_costs_the_loop_one_snapshot_per_interval(start_daemon):
    port = free_port()
    d = start_daemon(budget=f"{64 * PAGE}", extra=("--metrics-address", f"127.0.0.1:{port}"))
    honest = d.connect("honest")
    g = honest.region_group(1, 8 * PAGE)
    t0 = time.monotonic()
    before = value(scrape(port), "kvpool_snapshots_built_total")
    stop, on = threading.Event(), threading.Event()
    counts = [[0, 0] for _ in range(FLOODERS)]
    threads = [threading.Thread(target=flood, args=(port, stop, c, on), daemon=True)
               for c in counts]
    for t in threads:
        t.start()
    try:
        assert on.wait(60), "the flood is on"
        for i in range(GRANTS):  # the honest tenant is served throughout
            units = list(range(1 + i % 8))
            g.grant(units)
            g.release(units)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    m = scrape(port)
    elapsed = time.monotonic() - t0
    built = value(m, "kvpool_snapshots_built_total") - before
    scrapes = sum(c[0] for c in counts)
    bound = elapsed / MIN_INTERVAL_S + 3
    assert built <= bound, (f"{built:.0f} snapshots in {elapsed:.1f} s for {scrapes} "
                            f"scrapes: more than one per {MIN_INTERVAL_S} s")
    assert value(m, "kvpool_grants_total") >= GRANTS
    # a scrape after a change still shows it (a snapshot newer than the scrape)
    g.grant([0, 1, 2])
    assert value(scrape(port), "kvpool_tenant_mapped_bytes", tenant="honest") == 3 * PAGE
    honest.close()
    assert d.check() == []
