"""Grant latency with and without the daemon's Prometheus exporter (``alloc_bench.py
--metrics``): two daemons in the same run, one with ``--metrics-address`` scraped ten
times a second (far more often than Prometheus' usual 15 s), one without; grants of 1 and
8 pages alternate between them (interleaved: the same machine noise for both). Reports
median and p99 per batch and the ratio exporter / baseline; the acceptance is that the
ratio stays near 1 (the exporter adds nothing on the grant path but integer increments
and one event record; scrapes are answered between requests).

``--flood N``: N threads scrape back to back (no pause) instead, the attack of issue 24;
the exporter builds at most one snapshot per ``metrics.MIN_INTERVAL_S`` whatever the rate,
so the ratio should stay near 1 there too. The JSON also records the scrapes answered and
the snapshots the loop built (``kvpool_snapshots_built``)."""

from __future__ import annotations

import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common import summarize, write_result

from kvpool.demo.cluster import Cluster, free_port
from kvpool.sizes import format_size

BATCHES = (1, 8)
SCRAPE_S = 0.1


def scraper(port: int, stop: threading.Event, count: list[int], took: list[int],
            build: list[float], pause_s: float = SCRAPE_S) -> None:
    """Scrape every ``pause_s`` (0: back to back); record each scrape's latency, the
    loop's build time and its count of snapshots built (``count[1]``)."""
    while not stop.is_set():
        t0 = time.perf_counter_ns()
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=30).read()
        except OSError:
            continue  # a flood may find the backlog full
        took.append(time.perf_counter_ns() - t0)
        for line in text.decode().splitlines():
            if line.startswith("kvpool_snapshot_build_seconds "):
                build.append(float(line.split()[1]) * 1e9)
            elif line.startswith("kvpool_snapshots_built_total "):
                count[1] = max(count[1], int(float(line.split()[1])))
        count[0] += 1
        if pause_s:
            stop.wait(pause_s)


def run(page_size: int, backend: str, reps: int, out: str | None, flood: int = 0) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvpool.client_lib import connect

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvpbench-") as tmp, \
            Cluster(Path(tmp) / "a") as base_c, Cluster(Path(tmp) / "b") as metr_c:
        base_c.daemon(64 * page_size, page_size, extra=("--log-level", "WARNING"), backend=backend)
        metr_c.daemon(64 * page_size, page_size, backend=backend, extra=(
            "--log-level", "WARNING", "--metrics-address", f"127.0.0.1:{port}"))
        stop, scrapes, took, build = threading.Event(), [0, 0], [], []
        with connect(name="bench", run_dir=base_c.run_dir) as tb, \
                connect(name="bench", run_dir=metr_c.run_dir) as tm:
            threads = [threading.Thread(target=scraper, daemon=True,
                                        args=(port, stop, scrapes, took, build,
                                              0.0 if flood else SCRAPE_S))
                       for _ in range(max(1, flood))]
            for thread in threads:
                thread.start()
            t_start = time.monotonic()
            groups = {"baseline": tb.region_group(1, 16 * page_size),
                      "exporter": tm.region_group(1, 16 * page_size)}
            samples = {(k, n): [] for k in groups for n in BATCHES}
            try:
                for i in range(reps + 5):
                    for n in BATCHES:
                        for k, g in groups.items():
                            units = list(range(n))
                            t0 = time.perf_counter_ns()
                            g.grant(units)
                            t1 = time.perf_counter_ns()
                            g.release(units)
                            if i >= 5:  # warm-up: page creation, first faults
                                samples[k, n].append(t1 - t0)
            finally:
                stop.set()
                elapsed = time.monotonic() - t_start
                for thread in threads:
                    thread.join(60)
    rows = {}
    for n in BATCHES:
        b, m = summarize(samples["baseline", n]), summarize(samples["exporter", n])
        rows[str(n)] = {"baseline": b, "exporter": m,
                        "ratio_median": m["median_us"] / b["median_us"],
                        "ratio_p99": m["p99_us"] / b["p99_us"]}
    how = (f"flooded by {flood} threads scraping back to back" if flood
           else f"scraped every {SCRAPE_S:g} s")
    table = Table(title=f"grant latency with the exporter {how} vs without ({backend}, "
                        f"page {format_size(page_size)}, {scrapes[0]} scrapes, "
                        f"{scrapes[1]} snapshots built, {elapsed:.1f} s)")
    for col in ("batch", "baseline p50", "exporter p50", "ratio", "baseline p99",
                "exporter p99", "ratio"):
        table.add_column(col, justify="right")
    for n, r in rows.items():
        table.add_row(f"{n} pages", f"{r['baseline']['median_us']:.0f} µs",
                      f"{r['exporter']['median_us']:.0f} µs", f"{r['ratio_median']:.2f}x",
                      f"{r['baseline']['p99_us']:.0f} µs", f"{r['exporter']['p99_us']:.0f} µs",
                      f"{r['ratio_p99']:.2f}x")
    Console(width=120).print(table)
    scrape, built = summarize(took), summarize([int(x) for x in build])
    print(f"scrape latency: median {scrape['median_us']:.0f} µs, p99 {scrape['p99_us']:.0f} µs; "
          f"the loop's snapshot: median {built['median_us']:.0f} µs, p99 "
          f"{built['p99_us']:.0f} µs")
    path = write_result("alloc_bench_metrics_flood" if flood else "alloc_bench_metrics", {
        "backend": backend, "page_size": page_size, "reps": reps,
        "scrape_interval_s": 0.0 if flood else SCRAPE_S, "scraper_threads": max(1, flood),
        "seconds": elapsed, "scrapes": scrapes[0], "snapshots_built": scrapes[1],
        "grant": rows, "scrape_latency": scrape, "snapshot_build_in_loop": built}, out)
    print(f"wrote {path}")
