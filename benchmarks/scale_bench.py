"""Scale benchmark (host backend): one daemon holding 256 .. 8,192 pages across 32 tenants
and 256 region groups, next to a baseline daemon that holds 256 pages the whole time.

At each size N (the scaled daemon holds N pages; ``--page-size`` 64 KiB by default, so
the memory stays small on a shared machine while the page *count* is real):

* fill  — time to grant the pages added since the last size, per page (the holders
  grant in batches of up to 64 units per group);
* grant / release — one unit granted and released by a probe tenant, ``--reps`` times,
  interleaved with the same on the baseline daemon: medians, p99 and the ratio;
* ps / map — a monitor's ``ps`` and full ``map`` (all pages of a paged reply): latency,
  reply size (msgpack bytes), same interleaving and ratio;
* daemon RSS and open fds (one memfd per page it owns on host: granted + warm);
* dead tenant — a process holding ``--dead-pages`` pages (2,000) is killed with SIGKILL;
  the time until ``ps`` no longer lists it and those pages are off ``granted``, next to a
  clean close (``Bye``) of the same pages measured at the same size (medians of
  ``--dead-reps``, alternating).

The goal: a flat per-page cost and flat per-request latency from 256 to 4,096+ pages,
no step at 1,024 fds. Usage:

    .venv/bin/python benchmarks/scale_bench.py [--page-size 64KiB] [--sizes 256,...]

Prints a table and writes benchmarks/results/scale_bench.json (command, machine, numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import summarize, write_result  # noqa: E402

from kvpool.sizes import format_size, parse_size  # noqa: E402

BATCH = 64  # units per grant request in the holders
CHUNK = 256  # pages per fill step (the baseline grants as many next to each step)


def emit(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------- holder subprocesses
def holder(run_dir: str, prefix: str, tenants: int, groups: int, capacity: int) -> None:
    """``tenants`` sessions with ``groups`` groups in total (round robin), one region of
    ``capacity`` units each. Commands on stdin: ``fill N`` (grant or release until N
    pages are held, spread evenly over the groups; prints the time it took), ``close``
    (Bye each session, prints the time), EOF (exit)."""
    from kvpool.client_lib import Tenant

    ts = [Tenant(f"{prefix}{i}", run_dir=run_dir, keeper=False) for i in range(tenants)]
    gs = [ts[k % tenants].region_group(1, capacity * ts[0].page_size) for k in range(groups)]
    held = [0] * groups
    emit(event="ready", pid=os.getpid())
    for line in sys.stdin:
        cmd, *arg = line.split()
        t0 = time.perf_counter()
        if cmd == "fill":
            want = int(arg[0])
            per = [want // groups + (k < want % groups) for k in range(groups)]
            for k, g in enumerate(gs):
                while held[k] < per[k]:
                    n = min(BATCH, per[k] - held[k])
                    g.grant(range(held[k], held[k] + n))
                    held[k] += n
                while held[k] > per[k]:
                    n = min(BATCH, held[k] - per[k])
                    g.release(range(held[k] - n, held[k]))
                    held[k] -= n
            emit(event="filled", held=sum(held), s=time.perf_counter() - t0)
        elif cmd == "close":
            for t in ts:
                t.close()
            emit(event="closed", s=time.perf_counter() - t0)
            return


class Holder:
    """A holder subprocess (see :func:`holder`)."""

    def __init__(self, run_dir: str, prefix: str, tenants: int, groups: int, capacity: int):
        self.prefix = prefix
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--holder", run_dir, "--prefix", prefix,
             "--tenants", str(tenants), "--groups", str(groups), "--capacity", str(capacity)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.pid = self.read("ready")["pid"]

    def read(self, event: str) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"holder {self.prefix} exited ({self.proc.wait()})")
            msg = json.loads(line)
            if msg.get("event") == event:
                return msg

    def send(self, line: str, event: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read(event)

    def fill(self, n: int) -> dict:
        return self.send(f"fill {n}", "filled")

    def close(self) -> dict:
        return self.send("close", "closed")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------- measurements
class Target:
    """One daemon seen from the benchmark: a probe tenant, a monitor, its process."""

    def __init__(self, name: str, run_dir: str, daemon_pid: int):
        import psutil

        from kvpool.client_lib import Monitor, Tenant

        self.name = name
        self.probe = Tenant(f"probe-{name}", run_dir=run_dir, keeper=False)
        self.group = self.probe.region_group(1, 4 * self.probe.page_size)
        self.monitor = Monitor(run_dir, timeout_s=60)
        self.proc = psutil.Process(daemon_pid)

    def grant_release(self) -> tuple[int, int]:
        t0 = time.perf_counter_ns()
        self.group.grant([0])
        t1 = time.perf_counter_ns()
        self.group.release([0])
        return t1 - t0, time.perf_counter_ns() - t1

    def ps(self) -> tuple[int, int, int]:
        from kvpool import protocol as p

        t0 = time.perf_counter_ns()
        reply = self.monitor.ps()
        dt = time.perf_counter_ns() - t0
        return dt, len(p.encode(reply)), len(reply.tenants)

    def map(self) -> tuple[int, int, int, int]:
        """(ns, bytes over all pages, pages, groups) of one full map."""
        from kvpool import protocol as p

        t0 = time.perf_counter_ns()
        size = pages = groups = 0
        after = 0
        while True:
            reply = self.monitor.call(p.MapReq(after=after))
            size += len(p.encode(reply))
            pages += 1
            groups += len(reply.groups)
            if reply.next is None:
                break
            after = reply.next
        return time.perf_counter_ns() - t0, size, pages, groups

    def resources(self) -> dict:
        return {"rss_bytes": self.proc.memory_info().rss, "fds": self.proc.num_fds()}

    def close(self) -> None:
        self.probe.close()
        self.monitor.close()


def interleaved(a: Target, b: Target, fn, reps: int) -> tuple[list, list]:
    """``fn(target)`` ``reps`` times on each, alternating which goes first."""
    xa, xb = [], []
    for i in range(reps):
        for t, out in ((a, xa), (b, xb)) if i % 2 == 0 else ((b, xb), (a, xa)):
            out.append(fn(t))
    return xa, xb


def med(xs: list[int]) -> float:
    return statistics.median(xs)


def settle(monitor, limit_s: float = 120.0) -> float:
    """Wait until the daemon's idle maintenance is done (no dirty pages left to retire
    or replace), so one row's dead tenants do not load the next row's measurements."""
    t0 = time.perf_counter()
    while monitor.ps().pool.dirty and time.perf_counter() - t0 < limit_s:
        time.sleep(0.01)
    return time.perf_counter() - t0


def dead_tenant(run_dir: str, monitor, pages: int, capacity: int, how: str) -> float:
    """Seconds from SIGKILL (or close) of a process holding ``pages`` pages until ``ps``
    no longer lists it and ``granted`` dropped by them."""
    h = Holder(run_dir, f"dead-{how}-", 1, 1, capacity)
    try:
        h.fill(pages)
        before = monitor.ps().pool.granted
        page = monitor.ps().pool.page_size
        t0 = time.perf_counter()
        if how == "kill":
            os.kill(h.pid, signal.SIGKILL)
        else:
            h.proc.stdin.write("close\n")
            h.proc.stdin.flush()
        while True:
            ps = monitor.ps()
            if (not any(t.name.startswith(f"dead-{how}-") for t in ps.tenants)
                    and ps.pool.granted <= before - pages * page):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > 120:
                raise RuntimeError(f"{how}: the dead tenant's pages did not come back")
            time.sleep(0.001)
    finally:
        h.kill()


def run(args) -> dict:
    from kvpool.demo.cluster import Cluster

    page = parse_size(args.page_size)
    sizes = sorted(int(x) for x in args.sizes.split(","))
    top = sizes[-1]
    per_group = -(-top // args.groups)
    dead_cap = args.dead_pages
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpscale-") as tmp, \
            Cluster(Path(tmp) / "base") as base_c, Cluster(Path(tmp) / "scaled") as big_c:
        extra = ("--log-level", "WARNING",
                 *(("--warm-max", args.warm_max) if args.warm_max is not None else ()))
        base_d = base_c.daemon((sizes[0] + CHUNK + 64) * page, page, extra=extra)
        big_d = big_c.daemon((top + args.dead_pages + 64) * page, page, extra=extra)
        base_h = Holder(str(base_c.run_dir), "b", args.tenants, args.groups, per_group)
        big_h = Holder(str(big_c.run_dir), "s", args.tenants, args.groups, per_group)
        base_h.fill(sizes[0])
        base = Target("base", str(base_c.run_dir), base_d.popen.pid)
        big = Target("scaled", str(big_c.run_dir), big_d.popen.pid)
        try:
            prev = 0
            for n in sizes:
                # grow in chunks, each next to the baseline granting (then releasing) a chunk
                fill_s = fill_base_s = 0.0
                cur = prev
                while cur < n:
                    step = min(CHUNK, n - cur)
                    fill_s += big_h.fill(cur + step)["s"] / step
                    fill_base_s += base_h.fill(sizes[0] + step)["s"] / step
                    base_h.fill(sizes[0])
                    cur += step
                chunks = -(-(n - prev) // CHUNK)
                settle(big.monitor)
                settle(base.monitor)
                gr_a, gr_b = interleaved(base, big, Target.grant_release, args.reps)
                ps_a, ps_b = interleaved(base, big, Target.ps, args.ps_reps)
                map_a, map_b = interleaved(base, big, Target.map, args.map_reps)
                res = big.resources()
                pool = big.monitor.ps().pool
                runs = {"close": [], "kill": []}
                for i in range(args.dead_reps):  # alternating which goes first
                    for how in ("close", "kill") if i % 2 == 0 else ("kill", "close"):
                        runs[how].append(dead_tenant(str(big_c.run_dir), big.monitor,
                                                     args.dead_pages, dead_cap, how))
                        settle(big.monitor)
                dead = {how: statistics.median(xs) for how, xs in runs.items()}
                row = {
                    "pages": n,
                    "tenants": len(big.monitor.ps().tenants),
                    "groups": map_b[-1][3],
                    "fill_per_page_us": fill_s / chunks * 1e6,
                    "fill_per_page_base_us": fill_base_s / chunks * 1e6,
                    "fill_ratio": fill_s / fill_base_s,
                    "grant": summarize([g for g, _ in gr_b]),
                    "release": summarize([r for _, r in gr_b]),
                    "grant_base": summarize([g for g, _ in gr_a]),
                    "release_base": summarize([r for _, r in gr_a]),
                    "grant_ratio": med([g for g, _ in gr_b]) / med([g for g, _ in gr_a]),
                    "release_ratio": med([r for _, r in gr_b]) / med([r for _, r in gr_a]),
                    "ps": summarize([x[0] for x in ps_b]),
                    "ps_base": summarize([x[0] for x in ps_a]),
                    "ps_ratio": med([x[0] for x in ps_b]) / med([x[0] for x in ps_a]),
                    "ps_reply_bytes": ps_b[-1][1],
                    "map": summarize([x[0] for x in map_b]),
                    "map_base": summarize([x[0] for x in map_a]),
                    "map_ratio": med([x[0] for x in map_b]) / med([x[0] for x in map_a]),
                    "map_reply_bytes": map_b[-1][1],
                    "map_reply_pages": map_b[-1][2],
                    "daemon_rss_bytes": res["rss_bytes"],
                    "daemon_fds": res["fds"],
                    "warm_pages": pool.warm // page,
                    "dirty_pages": pool.dirty // page,
                    "retained_pages": pool.retained // page,
                    "dead_pages": args.dead_pages,
                    "dead_kill_s": dead["kill"],  # medians of dead_reps
                    "dead_kill_all_s": runs["kill"],
                    "dead_close_all_s": runs["close"],
                    "dead_close_s": dead["close"],
                    "dead_kill_to_close": dead["kill"] / dead["close"],
                    "daemon_fds_with_dead": res["fds"] + args.dead_pages,
                }
                rows.append(row)
                print_row(row)
                prev = n
            problems = big.monitor.check() + base.monitor.check()
            base_res = base.resources()
        finally:
            base.close()
            big.close()
            for h in (base_h, big_h):
                h.kill()
        alive = base_d.popen.poll() is None and big_d.popen.poll() is None
    first, last = rows[0], rows[-1]
    growth = {  # the largest size over the smallest: 1.0 is flat
        "pages": [first["pages"], last["pages"]],
        "fill_per_page": last["fill_per_page_us"] / first["fill_per_page_us"],
        "grant_median": last["grant"]["median_us"] / first["grant"]["median_us"],
        "release_median": last["release"]["median_us"] / first["release"]["median_us"],
        "ps_median": last["ps"]["median_us"] / first["ps"]["median_us"],
        "map_median": last["map"]["median_us"] / first["map"]["median_us"],
        "dead_kill": last["dead_kill_s"] / first["dead_kill_s"],
        "rss": last["daemon_rss_bytes"] / first["daemon_rss_bytes"],
    }
    growth_vs_baseline = {  # the same, each row first divided by its interleaved baseline
        k: last[f"{k}_ratio"] / first[f"{k}_ratio"]
        for k in ("fill", "grant", "release", "ps", "map")}
    return {"backend": "host", "page_size": page, "tenants": args.tenants, "growth": growth,
            "growth_vs_baseline": growth_vs_baseline,
            "groups": args.groups, "reps": args.reps, "warm_max": args.warm_max, "baseline_pages": sizes[0],
            "baseline_daemon": base_res, "rows": rows, "check_problems": problems,
            "daemons_alive_at_end": alive}


HEAD = (f"{'pages':>6} {'tenants':>7} {'groups':>6} {'fill/page':>9} {'x':>5} {'grant':>8} {'x':>5} "
        f"{'release':>8} {'x':>5} {'ps':>8} {'x':>5} {'ps B':>7} {'map':>8} {'x':>5} "
        f"{'map B':>8} {'RSS':>8} {'fds':>6} {'warm':>5} {'kill dead':>9} {'close dead':>10}")


def print_row(r: dict) -> None:
    if not getattr(print_row, "said", False):
        print(HEAD)
        print_row.said = True

    def us(x):
        return f"{x['median_us']:.0f}us" if x["median_us"] < 10_000 else f"{x['median_us'] / 1e3:.0f}ms"

    print(f"{r['pages']:>6} {r['tenants']:>7} {r['groups']:>6} {r['fill_per_page_us']:>7.0f}us "
          f"{r['fill_ratio']:>5.2f} "
          f"{us(r['grant']):>8} {r['grant_ratio']:>5.2f} {us(r['release']):>8} "
          f"{r['release_ratio']:>5.2f} {us(r['ps']):>8} {r['ps_ratio']:>5.2f} "
          f"{r['ps_reply_bytes']:>7} {us(r['map']):>8} {r['map_ratio']:>5.2f} "
          f"{r['map_reply_bytes']:>8} {format_size(r['daemon_rss_bytes']):>8} "
          f"{r['daemon_fds']:>6} {r['warm_pages']:>5} {r['dead_kill_s'] * 1e3:>7.0f}ms {r['dead_close_s'] * 1e3:>8.0f}ms",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", default="64KiB")
    ap.add_argument("--sizes", default="256,512,1024,2048,4096,8192",
                    help="pages the scaled daemon holds, one row each (first = baseline)")
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--reps", type=int, default=300, help="grant/release pairs per size")
    ap.add_argument("--ps-reps", type=int, default=40)
    ap.add_argument("--map-reps", type=int, default=20)
    ap.add_argument("--dead-pages", type=int, default=2000)
    ap.add_argument("--dead-reps", type=int, default=3, help="SIGKILL and close runs per size")
    ap.add_argument("--warm-max", default=None, help="the daemons' warm pool cap (default: "
                    "the daemon's own)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    ap.add_argument("--holder", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    ap.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.holder:
        holder(args.holder, args.prefix, args.tenants, args.groups, args.capacity)
        return
    print(f"scale bench: host backend, page {args.page_size}, {args.tenants} tenants, "
          f"{args.groups} groups; ratio x = scaled / baseline ({args.sizes.split(',')[0]} "
          f"pages) measured interleaved", flush=True)
    result = run(args)
    path = write_result("scale_bench", result, args.out)
    print("growth, largest / smallest size: " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["growth"].items() if k != "pages"))
    print("growth of the ratio to the interleaved baseline: " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["growth_vs_baseline"].items()))
    print(f"check: {result['check_problems'] or 'ok'}; daemons alive: "
          f"{result['daemons_alive_at_end']}; wrote {path}")


if __name__ == "__main__":
    main()
