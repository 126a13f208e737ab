"""Gang benchmark (host backend, ``--devices 2``; issue 26): what a collective grant
costs next to a single-device grant of the same units, and what reclaiming a TP=2
tenant costs next to a TP=1 tenant of the same bytes.

* grant: a TP=2 gang (two rank processes, one per device, each mapping its own
  descriptors; the latency is from the command to both ranks having mapped) vs one
  tenant process's grant of the same units on device 0 (the same command path); 1, 8
  and 64 pages per rank; grant and release interleaved rep by rep, the order
  alternating.
* reclaim: a lease on device 0 that needs every page the tenant holds there: a TP=1
  tenant holding P pages on device 0 (daemon A, budget P per device) vs a TP=2 gang
  holding P/2 pages on each device (daemon B, budget P/2 per device: the same bytes),
  each a process; the tenant's shrink callback releases what it is asked (the gang's
  ask is mirrored to both ranks, whose collective release returns both devices'
  pages). Reps interleaved.

    .venv/bin/python benchmarks/gang_bench.py [--reps 30] [--reclaim-reps 7]

Writes benchmarks/results/gang_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
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
SIZES = (1, 8, 64)


def worker(run_dir: str, role: str, name: str, device: int, pages: int,
           token: str) -> None:
    """One tenant process (a single-device tenant, or one rank of a TP=2 gang): on
    ``grant N`` / ``release N`` it grants or releases units ``0..N-1`` of its group
    (a collective for a rank) and answers ``ok`` once it mapped or unmapped them; it
    releases what a reclaim asks (highest units first; both ranks pick the same)."""
    from kvpool.client_lib import connect

    layout = [(1, pages * PAGE)]
    if role == "rank1":
        t = connect(name, device=device, run_dir=run_dir, gang=token, rank=1, layout=layout)
    else:
        t = connect(name, device=device, run_dir=run_dir)
        if role == "rank0":
            token = t.create_gang([0, 1], layout)
    g = t.region_group(1, pages * PAGE)

    def shrink(nbytes: int, urgent: bool) -> None:
        mapped = sorted(g.mapped)
        k = min(len(mapped), -(-nbytes // g.unit_bytes))
        if k:
            g.release(mapped[-k:])

    t.set_shrink_callback(shrink)
    print(f"ready {token}", flush=True)
    for line in sys.stdin:
        op, n = line.split()
        units = list(range(int(n)))
        if op == "grant":
            g.grant(units)
        else:
            g.release([u for u in units if u in g.mapped])
        print("ok", flush=True)
    t.close()


class Worker:
    def __init__(self, run_dir: str, role: str, name: str, device: int, pages: int,
                 token: str = "-"):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", run_dir, role, name, str(device),
             str(pages), token], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=REPO)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        ready = self.stdout.readline().split()
        assert ready and ready[0] == "ready", ready
        self.token = ready[1]

    def send(self, line: str) -> None:
        self.stdin.write(line + "\n")
        self.stdin.flush()

    def done(self) -> None:
        got = self.stdout.readline().strip()
        assert got == "ok", got

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(30)


def timed(workers: list[Worker], line: str) -> int:
    """Send ``line`` to every worker at once; nanoseconds until all of them are done."""
    t0 = time.perf_counter_ns()
    for w in workers:
        w.send(line)
    for w in workers:
        w.done()
    return time.perf_counter_ns() - t0


def gang(run_dir: str, name: str, pages: int) -> list[Worker]:
    r0 = Worker(run_dir, "rank0", name, 0, pages)
    return [r0, Worker(run_dir, "rank1", name, 1, pages, r0.token)]


def grant_latency(run_dir: str, reps: int) -> dict:
    most = max(SIZES)
    single = [Worker(run_dir, "single", "single", 0, most)]
    tp2 = gang(run_dir, "tp", most)
    out: dict = {}
    try:
        for n in SIZES:
            samples: dict[str, list[int]] = {"single": [], "gang": []}
            for rep in range(reps):
                order = ("single", "gang") if rep % 2 == 0 else ("gang", "single")
                for kind in order:
                    ws = single if kind == "single" else tp2
                    samples[kind].append(timed(ws, f"grant {n}"))
                    timed(ws, f"release {n}")
            s, g = summarize(samples["single"]), summarize(samples["gang"])
            out[str(n)] = {"single": s, "gang_tp2": g,
                           "ratio_median": g["median_us"] / s["median_us"],
                           "ratio_p99": g["p99_us"] / s["p99_us"]}
    finally:
        for w in single + tp2:
            w.close()
    return out


def reclaim_latency(run_a: str, run_b: str, pages: int, reps: int) -> dict:
    """Lease on device 0 reclaiming a TP=1 tenant (``pages`` on device 0, daemon A) vs
    a TP=2 gang (``pages // 2`` on each device, daemon B): the same bytes."""
    from kvpool.client_lib import connect

    half = pages // 2
    tp1 = [Worker(run_a, "single", "tp1", 0, pages)]
    tp2 = gang(run_b, "tp2", half)
    la = connect("lease-a", device=0, run_dir=run_a, kind="lease")
    lb = connect("lease-b", device=0, run_dir=run_b, kind="lease")
    samples: dict[str, list[int]] = {"tp1": [], "tp2": []}
    try:
        for rep in range(reps):
            order = ("tp1", "tp2") if rep % 2 == 0 else ("tp2", "tp1")
            for kind in order:
                ws, lt, n = (tp1, la, pages) if kind == "tp1" else (tp2, lb, half)
                timed(ws, f"grant {n}")
                t0 = time.perf_counter_ns()
                lease = lt.lease(n * PAGE)
                samples[kind].append(time.perf_counter_ns() - t0)
                lease.close()
                time.sleep(0.05)  # the tenants' answers (Reclaimed) are in
    finally:
        for w in tp1 + tp2:
            w.close()
        la.close()
        lb.close()
    a, b = summarize(samples["tp1"]), summarize(samples["tp2"])
    return {"bytes": pages * PAGE, "tp1": a, "tp2": b,
            "ratio_median": b["median_us"] / a["median_us"]}


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
                   "loadavg_after": list(os.getloadavg()),
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
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]),
               sys.argv[7])
    else:
        main()
