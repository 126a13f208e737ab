"""Gang benchmark (host backend, ``--devices 2``; issue 26): what a collective grant
costs next to a single-device grant of the same units, and what reclaiming a TP=2
tenant costs next to a TP=1 tenant of the same bytes.

* grant: a TP=2 gang (two sessions in this process, one per device, each rank's
  ``grant`` on its own thread, released together; the latency is until both returned)
  vs one session's grant of the same units on device 0; 1, 8 and 64 pages per rank;
  grant and release interleaved rep by rep, the order alternating.
* reclaim: a lease on device 0 that needs every page the tenant holds there: a TP=1
  tenant holding P pages on device 0 (daemon A, budget P per device) vs a TP=2 gang
  holding P/2 pages on each device (daemon B, budget P/2 per device: the same bytes);
  the tenant's shrink callback releases what it is asked (the gang's ask is mirrored to
  both ranks, whose collective release returns both devices' pages). Reps interleaved.

    .venv/bin/python benchmarks/gang_bench.py [--reps 30] [--reclaim-reps 7]

Writes benchmarks/results/gang_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import summarize, write_result  # noqa: E402

PAGE = 2 << 20
SIZES = (1, 8, 64)


class Pair:
    """Two threads that run one call each at the same moment (a collective)."""

    def __init__(self) -> None:
        self.go = [threading.Event(), threading.Event()]
        self.done = threading.Barrier(3)
        self.fns: list[Callable[[], None]] = [lambda: None, lambda: None]
        self.errors: list[BaseException] = []
        self.stop = False
        for i in range(2):
            threading.Thread(target=self._run, args=(i,), daemon=True).start()

    def _run(self, i: int) -> None:
        while True:
            self.go[i].wait()
            self.go[i].clear()
            if self.stop:
                return
            try:
                self.fns[i]()
            except BaseException as e:  # reported by run()
                self.errors.append(e)
            self.done.wait()

    def run(self, a: Callable[[], None], b: Callable[[], None]) -> int:
        """Both calls; nanoseconds until both returned."""
        self.fns = [a, b]
        t0 = time.perf_counter_ns()
        for ev in self.go:
            ev.set()
        self.done.wait()
        ns = time.perf_counter_ns() - t0
        if self.errors:
            raise self.errors.pop()
        return ns

    def close(self) -> None:
        self.stop = True
        for ev in self.go:
            ev.set()


def shrinker(g) -> Callable[[int, bool], None]:  # type: ignore[no-untyped-def]
    """Release the highest units covering ``nbytes`` (every rank picks the same)."""
    def shrink(nbytes: int, urgent: bool) -> None:
        mapped = sorted(g.mapped)
        k = min(len(mapped), -(-nbytes // g.unit_bytes))
        if k:
            g.release(mapped[-k:])
    return shrink


def grant_latency(run_dir: str, reps: int) -> dict:
    from kvpool.client_lib import connect

    most = max(SIZES)
    single = connect("single", device=0, run_dir=run_dir)
    sg = single.region_group(1, most * PAGE)
    r0 = connect("tp", device=0, run_dir=run_dir)
    token = r0.create_gang([0, 1], [(1, most * PAGE)])
    r1 = connect("tp", device=1, run_dir=run_dir, gang=token, rank=1, layout=[(1, most * PAGE)])
    g0, g1 = r0.region_group(1, most * PAGE), r1.region_group(1, most * PAGE)
    pair = Pair()
    out: dict = {}
    try:
        for n in SIZES:
            units = list(range(n))
            samples: dict[str, list[int]] = {"single": [], "gang": []}
            for rep in range(reps):
                order = ("single", "gang") if rep % 2 == 0 else ("gang", "single")
                for kind in order:
                    if kind == "single":
                        t0 = time.perf_counter_ns()
                        sg.grant(units)
                        samples["single"].append(time.perf_counter_ns() - t0)
                        sg.release(units)
                    else:
                        samples["gang"].append(pair.run(lambda: g0.grant(units),
                                                        lambda: g1.grant(units)))
                        pair.run(lambda: g0.release(units), lambda: g1.release(units))
            s, g = summarize(samples["single"]), summarize(samples["gang"])
            out[str(n)] = {"single": s, "gang_tp2": g,
                           "ratio_median": g["median_us"] / s["median_us"],
                           "ratio_p99": g["p99_us"] / s["p99_us"]}
    finally:
        pair.close()
        for t in (single, r0, r1):
            t.close()
    return out


def reclaim_latency(run_a: str, run_b: str, pages: int, reps: int) -> dict:
    """Lease on device 0 reclaiming a TP=1 tenant (``pages`` on device 0, daemon A) vs
    a TP=2 gang (``pages // 2`` on each device, daemon B)."""
    from kvpool.client_lib import connect

    half = pages // 2
    tp1 = connect("tp1", device=0, run_dir=run_a)
    g1 = tp1.region_group(1, pages * PAGE)
    tp1.set_shrink_callback(shrinker(g1))
    r0 = connect("tp2", device=0, run_dir=run_b)
    token = r0.create_gang([0, 1], [(1, half * PAGE)])
    r1 = connect("tp2", device=1, run_dir=run_b, gang=token, rank=1, layout=[(1, half * PAGE)])
    ga, gb = r0.region_group(1, half * PAGE), r1.region_group(1, half * PAGE)
    r0.set_shrink_callback(shrinker(ga))
    r1.set_shrink_callback(shrinker(gb))
    la = connect("lease-a", device=0, run_dir=run_a, kind="lease")
    lb = connect("lease-b", device=0, run_dir=run_b, kind="lease")
    pair = Pair()
    samples: dict[str, list[int]] = {"tp1": [], "tp2": []}
    try:
        for rep in range(reps):
            order = ("tp1", "tp2") if rep % 2 == 0 else ("tp2", "tp1")
            for kind in order:
                if kind == "tp1":
                    g1.grant(range(pages))
                    t0 = time.perf_counter_ns()
                    lease = la.lease(pages * PAGE)
                    samples["tp1"].append(time.perf_counter_ns() - t0)
                else:
                    pair.run(lambda: ga.grant(range(half)), lambda: gb.grant(range(half)))
                    t0 = time.perf_counter_ns()
                    lease = lb.lease(half * PAGE)
                    samples["tp2"].append(time.perf_counter_ns() - t0)
                lease.close()
                time.sleep(0.05)  # the tenants' answers (Reclaimed) are in
    finally:
        pair.close()
        for t in (tp1, r0, r1, la, lb):
            t.close()
    a, b = summarize(samples["tp1"]), summarize(samples["tp2"])
    return {"bytes": pages * PAGE, "tp1": a, "tp2": b, "ratio_median": b["median_us"] / a["median_us"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--reclaim-reps", type=int, default=7)
    ap.add_argument("--reclaim-pages", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvpool import launch

    dirs = [tempfile.mkdtemp(prefix="kvp-gang-") for _ in range(3)]
    common = ("--devices", "2", "--warm-max", "0", "--log-level", "WARNING")
    daemons = []
    try:
        daemons.append(launch.start_daemon(dirs[0], *common, budget=4 * max(SIZES) * PAGE,
                                           page_size=PAGE, cwd=REPO))
        daemons.append(launch.start_daemon(dirs[1], *common, budget=args.reclaim_pages * PAGE,
                                           page_size=PAGE, cwd=REPO))
        daemons.append(launch.start_daemon(dirs[2], *common,
                                           budget=args.reclaim_pages // 2 * PAGE,
                                           page_size=PAGE, cwd=REPO))
        grants = grant_latency(dirs[0], args.reps)
        reclaim = reclaim_latency(dirs[1], dirs[2], args.reclaim_pages, args.reclaim_reps)
        payload = {"backend": "host", "page_size": PAGE, "reps": args.reps,
                   "reclaim_reps": args.reclaim_reps, "grant": grants, "reclaim": reclaim,
                   "goal": "gang grant median <= 1.5x the single-device grant's"}
        path = write_result("gang_bench", payload, args.out)
        print(f"{'pages/rank':>10} {'single p50':>11} {'gang p50':>9} {'ratio':>6} "
              f"{'single p99':>11} {'gang p99':>9} {'ratio':>6}   (us)")
        for n, row in grants.items():
            s, g = row["single"], row["gang_tp2"]
            print(f"{n:>10} {s['median_us']:>11.0f} {g['median_us']:>9.0f} "
                  f"{row['ratio_median']:>6.2f} {s['p99_us']:>11.0f} {g['p99_us']:>9.0f} "
                  f"{row['ratio_p99']:>6.2f}")
        print(f"reclaim of {reclaim['bytes'] >> 20} MiB by a lease: TP=1 median "
              f"{reclaim['tp1']['median_us'] / 1e3:.1f} ms, TP=2 "
              f"{reclaim['tp2']['median_us'] / 1e3:.1f} ms (ratio "
              f"{reclaim['ratio_median']:.2f}) -> {path}")
    finally:
        for d in daemons:
            d.stop()
        for x in dirs:
            shutil.rmtree(x, ignore_errors=True)


if __name__ == "__main__":
    main()
