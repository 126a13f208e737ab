"""Tenants of a real daemon on one device: grant, write, kill -9, zeros, fresh pages.

    python benchmarks/gpu_daemon_check.py --backend cuda     # on a GPU (gpu_check.sh step)
    python benchmarks/gpu_daemon_check.py --backend host     # the same mechanics on a CPU

A daemon (``--backend``) with a budget of ``--pages`` pages, then:

1. ``grant_write``: tenant *victim* (its own process) is granted every page of the budget,
   writes 0xA1 into every byte and reads it back;
2. ``kill_frees_memory``: ``kill -9`` of the victim; the daemon drops it, and the device's
   free memory (``cuMemGetInfo``) comes back to the baseline taken before the victim
   started, less what the daemon itself holds beyond what it held then (warm pages);
   skipped on the host backend, which has no device-wide counter;
3. ``next_reads_zeros``: tenant *next* is then granted the whole budget: every byte is 0;
4. ``fresh_after_change``: tenant *keeper* writes 0x5A into half the budget, keeps a
   reference to those pages the way a hostile tenant can (``cuMemRetainAllocationHandle``
   on CUDA, a duplicate of the memfd on the host), and releases them; tenant *newcomer*
   is granted the whole budget and writes 0xC3 everywhere; the keeper's pages must never
   show 0xC3 (a page that changes tenant is an allocation the previous one never held);
5. ``daemon_check``: ``kvpool check`` finds nothing wrong at the end.

Prints a table, writes benchmarks/results/gpu_daemon_check_<backend>.json (or --out) and
exits 1 when a check fails.
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

from common import write_result  # noqa: E402

from kvpool.sizes import format_size, parse_size  # noqa: E402

VICTIM, KEEPER, NEWCOMER = 0xA1, 0x5A, 0xC3
TOL = 64 << 20  # device-wide counter: slack for page tables and torch's small buffers


def fill(group, nbytes: int, value: int) -> int:
    """Write ``value`` into the first ``nbytes`` of region 0; returns bytes that read back
    different (0 when the write landed)."""
    import torch

    view = group.tensor(0, torch.uint8, nbytes=nbytes)
    view.fill_(value)
    sync(group.backend)
    return int(torch.count_nonzero(view != value))


def count(backend, rng, nbytes: int, value: int | None = None) -> int:
    """Bytes of ``rng`` equal to ``value`` (or nonzero bytes when ``value`` is None)."""
    import torch

    from kvpool.client_lib.tensors import tensor_view

    view = tensor_view(backend, rng, torch.uint8, nbytes=nbytes)
    n = torch.count_nonzero(view if value is None else view == value)
    return int(n)


def sync(backend) -> None:
    if backend.caps.tensor_device == "cuda":
        import torch

        torch.cuda.synchronize()


def keep_reference(group, unit: int):
    """A new reference to the page mapped at ``unit`` that outlives the group's release,
    as a hostile tenant could take one."""
    b = group.backend
    if b.name == "cuda":
        return b.retain_handle(group.unit_address(0, unit))
    return b.import_(group.handles[unit][0].handle)  # host: dup of the memfd


# ---------------------------------------------------------------------------- the victim
def victim_main(run_dir: str, npages: int) -> None:
    """Tenant process: take the whole budget, write it, report, then wait to be killed."""
    from kvpool.client_lib import connect

    tenant = connect(name="victim", run_dir=run_dir)
    g = tenant.region_group(1, npages * tenant.page_size, label="victim")
    g.grant(list(range(npages)))
    wrong = fill(g, npages * tenant.page_size, VICTIM)
    print(json.dumps({"ready": True, "wrong_bytes": wrong, "pid": os.getpid()}), flush=True)
    while True:
        time.sleep(60)


def start_victim(run_dir: Path, npages: int, timeout_s: float) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--victim", str(run_dir), "--pages", str(npages)],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    for line in proc.stdout or ():  # the first JSON line with "ready" (skip any chatter)
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("ready"):
            return proc, msg
    raise RuntimeError(f"the victim tenant exited (rc={proc.wait(timeout_s)}) before it "
                       "held its pages")


# ---------------------------------------------------------------------------- parent side
class Device:
    """Device-wide free memory (CUDA only) and what the daemon says it holds."""

    def __init__(self, kind: str, run_dir: Path):
        from kvpool.client_lib import Monitor

        self.monitor = Monitor(run_dir)
        self.backend = None
        if kind == "cuda":
            import torch

            from kvpool.vmm.cuda import CudaBackend

            torch.zeros(1, device="cuda").sum().item()  # torch's context and pools first
            self.backend = CudaBackend()

    def free(self) -> int | None:
        return self.backend.mem_info()[0] if self.backend is not None else None

    def held(self) -> int:
        """Bytes of device memory the daemon holds: granted + warm + dirty pages."""
        pool = self.monitor.ps().pool
        return pool.granted + pool.warm + pool.dirty

    def tenants(self) -> list[str]:
        return [t.name for t in self.monitor.ps().tenants]

    def close(self) -> None:
        self.monitor.close()
        if self.backend is not None:
            self.backend.close()


def wait_until(pred, timeout_s: float, step_s: float = 0.05) -> float | None:
    """Seconds until ``pred()`` held, or None at the deadline."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(step_s)
    return None


def check_kill(dev: Device, run_dir: Path, npages: int, ps: int, timeout_s: float) -> dict:
    base_free, base_held = dev.free(), dev.held()
    proc, ready = start_victim(run_dir, npages, timeout_s)
    out: dict = {"grant_write": {"ok": ready["wrong_bytes"] == 0, **ready}}
    with_victim = dev.free()
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout_s)
    gone = wait_until(lambda: "victim" not in dev.tenants() and dev.monitor.ps().pool.granted
                      == 0, timeout_s)
    res: dict = {"daemon_dropped_s": gone, "baseline_free": base_free,
                 "free_with_victim": with_victim, "victim_bytes": npages * ps}
    if base_free is None:
        res |= {"ok": gone is not None, "memory": "skipped: the host backend has no "
                "device-wide free-memory counter"}
    else:
        def back() -> bool:
            return dev.free() >= base_free - (dev.held() - base_held) - TOL

        came_back = wait_until(back, timeout_s) if gone is not None else None
        after = dev.free()
        res |= {"ok": gone is not None and came_back is not None,
                "memory_back_s": None if came_back is None else came_back + gone,
                "free_after": after, "daemon_held_delta": dev.held() - base_held,
                "victim_dropped_free_by": base_free - with_victim,
                "recovered": after - with_victim, "since_kill_s": time.monotonic() - t0}
    out["kill_frees_memory"] = res
    return out


def check_zeros(run_dir: Path, npages: int) -> dict:
    from kvpool.client_lib import connect

    with connect(name="next", run_dir=run_dir) as t:
        g = t.region_group(1, npages * t.page_size, label="next")
        t0 = time.monotonic()
        g.grant(list(range(npages)))
        grant_s = time.monotonic() - t0
        nonzero = count(t.backend, g.ranges[0], npages * t.page_size)
        g.release(list(range(npages)))
        g.close()
    return {"next_reads_zeros": {"ok": nonzero == 0, "nonzero_bytes": nonzero,
                                 "bytes": npages * t.page_size, "grant_s": grant_s}}


def grant_most(group, first: int, then: int) -> int:
    """Grant units 0..first-1, or 0..then-1 when the daemon refuses that many (it may
    count pages a tenant kept after releasing them against the budget); the count."""
    from kvpool.client_lib.errors import KvpoolError

    try:
        group.grant(list(range(first)))
        return first
    except KvpoolError:
        group.grant(list(range(then)))
        return then


def check_fresh(run_dir: Path, npages: int) -> dict:
    from kvpool.client_lib import connect

    half = max(1, npages // 2)
    keeper = connect(name="keeper", run_dir=run_dir)
    try:
        b, ps = keeper.backend, keeper.page_size
        g = keeper.region_group(1, half * ps, label="keeper")
        units = list(range(half))
        g.grant(units)
        fill(g, half * ps, KEEPER)
        kept = [keep_reference(g, u) for u in units]
        g.release(units)
        g.close()
        with connect(name="newcomer", run_dir=run_dir) as c:
            cg = c.region_group(1, npages * ps, label="newcomer")
            got = grant_most(cg, npages, npages - half)
            wrong = fill(cg, got * ps, NEWCOMER)
            rng = b.reserve(half * ps)
            b.map_pages(rng, 0, kept)
            leaked = count(b, rng, half * ps, NEWCOMER)
            own = count(b, rng, half * ps, KEEPER)
            b.unmap(rng, 0, half)
            b.free_range(rng)
            for page in kept:
                b.release(page)
            cg.release(list(range(got)))
            cg.close()
    finally:
        keeper.close()
    return {"fresh_after_change": {
        "ok": leaked == 0 and wrong == 0, "kept_pages": half, "newcomer_pages": got,
        "newcomer_bytes_seen_by_keeper": leaked, "keeper_bytes_still_its_own": own,
        "newcomer_wrong_bytes": wrong}}


def run(kind: str, npages: int, ps: int, timeout_s: float) -> dict:
    from kvpool.demo.cluster import Cluster

    checks: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvp-gpucheck-") as tmp, Cluster(Path(tmp)) as cl:
        cl.daemon(npages * ps, ps, extra=("--log-level", "WARNING"), backend=kind)
        dev = Device(kind, cl.run_dir)
        try:
            steps = {"kill": lambda: check_kill(dev, cl.run_dir, npages, ps, timeout_s),
                     "zeros": lambda: check_zeros(cl.run_dir, npages),
                     "fresh": lambda: check_fresh(cl.run_dir, npages)}
            for name, step in steps.items():
                try:
                    checks |= step()
                except Exception as e:  # record it and go on: the other checks still run
                    checks[f"{name}_error"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            problems = dev.monitor.check()
            checks["daemon_check"] = {"ok": not problems, "problems": problems}
        finally:
            dev.close()
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host")
    ap.add_argument("--pages", type=int, default=128, help="pages in the budget")
    ap.add_argument("--page-size", default="2MiB")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per wait")
    ap.add_argument("--out", default=None)
    ap.add_argument("--victim", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pages < 2:
        sys.exit("error: --pages must be at least 2")
    if args.victim:
        victim_main(args.victim, args.pages)
        return
    ps = parse_size(args.page_size)
    checks = run(args.backend, args.pages, ps, args.timeout)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"daemon on the {args.backend} backend: {args.pages} pages of "
                        f"{format_size(ps)}")
    for col in ("check", "result", "details"):
        table.add_column(col)
    for name, r in checks.items():
        details = ", ".join(f"{k}={v}" for k, v in r.items() if k != "ok")
        table.add_row(name, "pass" if r["ok"] else "FAIL", details)
    Console(width=160).print(table)
    ok = all(r["ok"] for r in checks.values())
    path = write_result(f"gpu_daemon_check_{args.backend}", {
        "backend": args.backend, "pages": args.pages, "page_size": ps, "ok": ok,
        "checks": checks}, args.out)
    print(f"wrote {path}: {'all checks pass' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
