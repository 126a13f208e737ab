"""Recovery latency (host backend): how long the daemon takes to get memory back, each
next to a baseline measured interleaved in the same run. These are the latencies the
tests no longer assert (they check the outcome with generous deadlines):

* ``tenant_kill``   — SIGKILL of a tenant holding ``--pages`` pages, until ``ps`` no longer
  lists it and ``granted`` dropped; baseline ``tenant_close`` (a clean ``Bye``);
* ``pid_death``     — the same, but a forked child inherited the fd channel, so there is no
  EOF: the daemon learns of the death from the pidfd; baseline ``tenant_kill``;
* ``lease_kill``    — SIGKILL of a lease holder, until ``leased`` is 0; baseline
  ``lease_close`` (``Lease.close``);
* ``limit_lower``   — ``set_limit`` to a quarter of what an idle tenant holds (its cache
  evicted by its shrink callback), until it holds no more than that; baseline
  ``limit_noop`` (a ``set_limit`` applied at once).

    .venv/bin/python benchmarks/recovery_bench.py [--reps 15] [--pages 32]

Prints a table and writes benchmarks/results/recovery_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import summarize, write_result  # noqa: E402

from kvpool.sizes import parse_size  # noqa: E402


def emit(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------- child process
def child(run_dir: str, mode: str, name: str, pages: int) -> None:
    """One tenant in ``mode`` (hold | fork | lease | cache); then obeys ``close`` on stdin."""
    import threading

    from kvpool.client_lib import ElasticBlockAllocator, connect

    t = connect(name=name, run_dir=run_dir)
    page = t.page_size
    extra: dict = {}
    lease = None
    if mode in ("hold", "fork"):
        g = t.region_group(1, pages * page)
        g.grant(range(pages))
        if mode == "fork":
            os.set_inheritable(t.conn.fdsock.fileno(), True)
            kid = os.fork()
            if kid == 0:
                time.sleep(600)
                os._exit(0)
            extra["kid"] = kid
    elif mode == "lease":
        lease = t.lease(pages * page)
    elif mode == "cache":
        g = t.region_group(1, 2 * pages * page)
        a = ElasticBlockAllocator(g, page, low=0, high=0, idle_timeout_s=600)
        lock = threading.Lock()
        held = a.alloc(pages)

        def shrink(nbytes: int, urgent: bool) -> None:
            with lock:
                k = min(len(held), -(-nbytes // page))
                a.free([held.pop() for _ in range(k)])

        t.set_shrink_callback(shrink)
    emit(event="ready", pid=os.getpid(), **extra)
    for line in sys.stdin:
        if line.strip() == "close":
            if lease is not None:
                lease.close()
            else:
                t.close()
            emit(event="closed")
    time.sleep(600)


class Child:
    def __init__(self, run_dir: str, mode: str, name: str, pages: int):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", run_dir, "--mode", mode, "--name", name,
             "--pages", str(pages)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=REPO)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child {name} ({mode}) exited: {self.proc.wait()}")
        self.ready = json.loads(line)

    def close(self) -> None:
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        if "kid" in self.ready:
            try:
                os.kill(self.ready["kid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def until(pred, start: int, limit_s: float = 60.0) -> int:
    """Nanoseconds from ``start`` until ``pred()`` holds (polled every ~0.5 ms)."""
    while not pred():
        if time.perf_counter_ns() - start > limit_s * 1e9:
            raise RuntimeError("not reached in time")
        time.sleep(0.0005)
    return time.perf_counter_ns() - start


def names(m) -> set[str]:
    return {t.name for t in m.ps().tenants}


# ----------------------------------------------------------------------- measurements
def tenant_gone(run_dir: str, m, mode: str, pages: int, how: str, i: int) -> int:
    name = f"{mode}-{how}-{i}"
    c = Child(run_dir, mode, name, pages)
    try:
        granted = m.ps().pool.granted
        page = m.ps().pool.page_size
        t0 = time.perf_counter_ns()
        if how == "kill":
            os.kill(c.ready["pid"], signal.SIGKILL)
        else:
            c.close()

        def back() -> bool:
            ps = m.ps()
            return (name not in {t.name for t in ps.tenants}
                    and ps.pool.granted <= granted - pages * page)
        return until(back, t0)
    finally:
        c.end()


def lease_gone(run_dir: str, m, pages: int, how: str, i: int) -> int:
    c = Child(run_dir, "lease", f"lease-{how}-{i}", pages)
    try:
        assert m.stats().pool.leased > 0
        t0 = time.perf_counter_ns()
        if how == "kill":
            os.kill(c.ready["pid"], signal.SIGKILL)
        else:
            c.close()
        return until(lambda: m.stats().pool.leased == 0, t0)
    finally:
        c.end()


def limit_change(run_dir: str, m, pages: int, how: str, i: int) -> int:
    name = f"cache-{how}-{i}"
    c = Child(run_dir, "cache", name, pages)
    try:
        page = m.ps().pool.page_size
        new = pages // 4 if how == "lower" else 2 * pages
        t0 = time.perf_counter_ns()
        m.set_limit(name, new * page)

        def held() -> int:
            return {t.name: t.mapped for t in m.ps().tenants}.get(name, 0)
        return until(lambda: held() <= new * page, t0)
    finally:
        c.end()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--page-size", default="64KiB")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.mode, args.name, args.pages)
        return

    from kvpool.client_lib import Monitor
    from kvpool.demo.cluster import Cluster

    page = parse_size(args.page_size)
    pairs = {  # name: (measure, baseline) as functions of (run_dir, monitor, i)
        "tenant_kill": (lambda r, m, i: tenant_gone(r, m, "hold", args.pages, "kill", i),
                        lambda r, m, i: tenant_gone(r, m, "hold", args.pages, "close", i),
                        "tenant_close"),
        "pid_death": (lambda r, m, i: tenant_gone(r, m, "fork", args.pages, "kill", i),
                      lambda r, m, i: tenant_gone(r, m, "hold", args.pages, "kill", 1000 + i),
                      "tenant_kill"),
        "lease_kill": (lambda r, m, i: lease_gone(r, m, args.pages, "kill", i),
                       lambda r, m, i: lease_gone(r, m, args.pages, "close", i),
                       "lease_close"),
        "limit_lower": (lambda r, m, i: limit_change(r, m, args.pages, "lower", i),
                        lambda r, m, i: limit_change(r, m, args.pages, "noop", i),
                        "limit_noop"),
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvprec-") as tmp, Cluster(Path(tmp)) as cluster:
        cluster.daemon(8 * args.pages * page, page, extra=("--log-level", "WARNING"))
        run_dir = str(cluster.run_dir)
        with Monitor(run_dir, timeout_s=30) as m:
            for event, (measure, baseline, base_name) in pairs.items():
                xs, bs = [], []
                for i in range(args.reps):
                    for fn, out in ((measure, xs), (baseline, bs)) if i % 2 == 0 else \
                            ((baseline, bs), (measure, xs)):
                        out.append(fn(run_dir, m, i))
                s, b = summarize(xs), summarize(bs)
                results[event] = {"event": s, "baseline_name": base_name, "baseline": b,
                                  "ratio_median": s["median_us"] / b["median_us"]}
                print(f"{event:12} median {s['median_us'] / 1e3:8.2f} ms  p99 "
                      f"{s['p99_us'] / 1e3:8.2f} ms | {base_name:12} median "
                      f"{b['median_us'] / 1e3:8.2f} ms  p99 {b['p99_us'] / 1e3:8.2f} ms | "
                      f"ratio {results[event]['ratio_median']:5.2f}", flush=True)
            problems = m.check()
    path = write_result("recovery_bench", {"backend": "host", "page_size": page,
                                           "pages": args.pages, "reps": args.reps,
                                           "events": results, "check_problems": problems},
                        args.out)
    print(f"check: {problems or 'ok'}; wrote {path}")


if __name__ == "__main__":
    main()
