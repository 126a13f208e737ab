"""Reclaim benchmark (host backend): how fast a lease of 50% of the budget is granted
while idle tenants hold the whole budget in reserves and cached blocks, next to the floor
measured in the same run (unmapping and releasing the same number of pages directly,
no daemon); and the idle footprint (what an idle tenant still holds after its idle
timeout, in allocation units).

    .venv/bin/python benchmarks/reclaim_bench.py [--reps 5] [--budget-pages 128]

Writes benchmarks/results/reclaim_bench.json.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import summarize, write_result  # noqa: E402

PAGE = 2 << 20


def tenant(run_dir: str, name: str, blocks: int) -> None:
    """An engine-like tenant: on "fill" it caches ``blocks`` blocks (evictable by the
    shrink callback) and a reserve, then its main thread idles until the next line."""
    import threading

    from kvpool.client_lib import ElasticBlockAllocator, connect

    t = connect(name=name, run_dir=run_dir)
    g = t.region_group(1, 4 * blocks * PAGE)
    a = ElasticBlockAllocator(g, PAGE, low=4, high=8, idle_timeout_s=600, populate=True)
    lock = threading.Lock()
    held: list[int] = []

    def shrink(nbytes: int, urgent: bool) -> None:
        with lock:
            k = min(len(held), -(-nbytes // PAGE))
            victims = held[-k:] if k else []
            del held[len(held) - k:]
            a.free(victims)

    t.set_shrink_callback(shrink)
    for line in sys.stdin:
        if line.strip() == "fill":
            while True:
                with lock:
                    if len(held) >= blocks:
                        break
                got = a.alloc(1)
                if got is None:
                    time.sleep(0.01)
                    continue
                with lock:
                    held.extend(got)
            deadline = time.monotonic() + 2
            while a.reserve_chunks < a.low and time.monotonic() < deadline:
                time.sleep(0.01)
            print("filled", flush=True)
    t.close()


def floor(npages: int, reps: int) -> dict:
    """Unmap and release ``npages`` mapped, touched pages directly (no daemon)."""
    from kvpool.vmm.host import HostBackend

    b = HostBackend(page_size=PAGE)
    samples = []
    for _ in range(reps):
        rng = b.reserve(npages * PAGE)
        pages = [b.create_page() for _ in range(npages)]
        b.map_pages(rng, 0, pages, True)
        t0 = time.perf_counter_ns()
        b.unmap(rng, 0, npages)
        for page in pages:
            b.release(page)
        samples.append(time.perf_counter_ns() - t0)
        b.free_range(rng)
    b.close()
    return summarize(samples)


def idle_footprint(run_dir: str) -> dict:
    from kvpool.client_lib import ElasticBlockAllocator, Monitor, connect

    with connect(name="idler", run_dir=run_dir) as t:
        g = t.region_group(1, 64 * PAGE)
        a = ElasticBlockAllocator(g, PAGE // 4, low=2, high=8, idle_timeout_s=0.5)
        blocks = a.alloc(40)
        a.free(blocks[1:])  # one block stays in use, the rest is cache/reserve
        time.sleep(2.0)
        with Monitor(run_dir) as m:
            (me,) = [x for x in m.ps().tenants if x.name == "idler"]
        a.free(blocks[:1])
        return {"idle_timeout_s": 0.5, "mapped_bytes": me.mapped,
                "units": me.mapped / g.unit_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-pages", type=int, default=128)
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvpool import launch
    from kvpool.client_lib import Monitor, connect

    run_dir = tempfile.mkdtemp(prefix="kvp-bench-")
    budget = args.budget_pages * PAGE
    daemon = launch.start_daemon(run_dir, "--warm-max", "0", "--log-level", "WARNING",
                                 budget=budget, page_size=PAGE, cwd=REPO)
    procs = []
    try:
        per = args.budget_pages // args.tenants - 8  # cached blocks; reserves fill the rest
        for i in range(args.tenants):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--tenant", run_dir, f"engine{i}", str(per)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO))
        lease_ns, held_before = [], []
        with connect(name="trainer", run_dir=run_dir, kind="lease") as t, Monitor(run_dir) as m:
            for _ in range(args.reps):
                for p in procs:
                    p.stdin.write("fill\n")
                    p.stdin.flush()
                for p in procs:
                    assert p.stdout.readline().strip() == "filled"
                time.sleep(0.3)
                held_before.append(m.stats().pool.granted)
                t0 = time.perf_counter_ns()
                lease = t.lease(budget // 2)
                lease_ns.append(time.perf_counter_ns() - t0)
                lease.close()
        result_floor = floor(args.budget_pages // 2, args.reps)
        footprint = idle_footprint(run_dir)
        lease_sum = summarize(lease_ns)
        payload = {
            "backend": "host", "page_size": PAGE, "budget_bytes": budget,
            "tenants": args.tenants, "lease_bytes": budget // 2,
            "granted_before_lease_bytes": held_before,
            "lease_grant": lease_sum, "floor_unmap_release": result_floor,
            "ratio_to_floor_median": lease_sum["median_us"] / result_floor["median_us"],
            "idle_footprint": footprint,
        }
        path = write_result("reclaim_bench", payload, args.out)
        print(f"lease of {budget // 2 >> 20} MiB with the budget full: median "
              f"{lease_sum['median_us'] / 1e3:.1f} ms (floor {result_floor['median_us'] / 1e3:.2f} "
              f"ms, ratio {payload['ratio_to_floor_median']:.1f}x); idle footprint "
              f"{footprint['units']:.0f} unit(s) -> {path}")
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(10)
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--tenant":
        tenant(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
