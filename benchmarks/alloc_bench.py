"""Allocation cost through kvpool: the client's fast path, and the slow path next to its floor.

* fast path — ``ElasticBlockAllocator.alloc`` + ``free`` of blocks in already mapped units
  (no system call, no message): cost per block.
* slow path — ``RegionGroup.grant`` of a batch of 1, 8 and 64 pages through a real daemon,
  end to end: request -> descriptors received -> pages mapped -> one byte written per page.
* floor — the same work without the daemon, measured in the same run: a raw ZeroMQ
  DEALER/ROUTER round trip to a minimal server process, which passes the same number of
  memfds over a SOCK_SEQPACKET socket first; the client imports and maps them with the
  same backend calls and writes the same bytes.

Usage: .venv/bin/python benchmarks/alloc_bench.py [--page-size 2MiB] [--quick] [--backend cuda]
Writes benchmarks/results/alloc_bench.json (alloc_bench_cuda.json with --backend cuda;
command, machine, timestamp, numbers). On CUDA the floor server exports ``cuMemCreate``
pages once and the byte per page is written with ``cuMemsetD8Async`` + one synchronize.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import write_result  # noqa: E402

from kvpool import fdchannel  # noqa: E402
from kvpool.demo.cluster import Cluster  # noqa: E402
from kvpool.sizes import format_size, parse_size  # noqa: E402

BATCHES = (1, 8, 64)


def touch(backend, addrs: list[int]) -> None:
    """Write one byte (1) at each address: a CPU store on host, a device memset on CUDA."""
    if backend.caps.tensor_device == "cpu":  # host-addressable memory
        for a in addrs:
            ctypes.memset(a, 1, 1)
        return
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        from cuda import cuda as cu
    for a in addrs:
        (err,) = cu.cuMemsetD8Async(a, 1, 1, 0)
        assert int(err) == 0, f"cuMemsetD8Async({a:#x}) failed: {err}"
    (err,) = cu.cuCtxSynchronize()
    assert int(err) == 0, f"cuCtxSynchronize failed: {err}"


# ---------------------------------------------------------------------------- floor server
def floor_server(run_dir: str, page_size: int, npages: int, kind: str = "host") -> None:
    """A minimal server: on a request for N pages, send N page fds, then reply (no logic)."""
    import zmq

    from kvpool.vmm import open_backend

    backend = open_backend(kind, page_size=page_size)
    pages = [backend.create_page() for _ in range(npages)]
    fds = [backend.export(pg) for pg in pages]
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{run_dir}/floor.sock")
    listener = fdchannel.listen(f"{run_dir}/floor-pages.sock")
    conn, _ = listener.accept()
    print("ready", flush=True)
    while True:
        ident, frame = router.recv_multipart()
        n = int(frame)
        if n < 0:
            break
        for first in range(0, n, fdchannel.MAX_FDS):
            fdchannel.send_fds(conn, b"h", fds[first : min(n, first + fdchannel.MAX_FDS)])
        router.send_multipart([ident, b"ok"])
    conn.close()
    router.close(0)
    ctx.term()


class FloorClient:
    def __init__(self, run_dir: str, page_size: int, npages: int, kind: str = "host"):
        import zmq

        from kvpool.vmm import open_backend

        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--floor-server", run_dir, "--page-size", str(page_size),
             "--floor-pages", str(npages), "--backend", kind], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not os.path.exists(f"{run_dir}/floor-pages.sock"):
            assert time.monotonic() < deadline, "floor server did not start"
            time.sleep(0.01)
        self.fdsock = fdchannel.connect(f"{run_dir}/floor-pages.sock")
        assert self.proc.stdout.readline().strip() == "ready"
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"ipc://{run_dir}/floor.sock")
        self.backend = open_backend(kind, page_size=page_size)
        self.page_size = page_size
        self.rng = self.backend.reserve(npages * page_size)

    def grant(self, n: int) -> None:
        """The floor of a grant of ``n`` pages: round trip + fds + map + touch."""
        self.sock.send(str(n).encode())
        self.sock.recv()
        fds: list[int] = []
        while len(fds) < n:
            fds += fdchannel.recv_fds(self.fdsock)[1]
        with fdchannel.closing(fds):
            pages = [self.backend.import_(fd) for fd in fds]
            self.backend.map_pages(self.rng, 0, pages)
            for pg in pages:
                self.backend.release(pg)
        touch(self.backend, [self.rng.base + i * self.page_size for i in range(n)])

    def ungrant(self, n: int) -> None:
        self.backend.unmap(self.rng, 0, n)

    def close(self) -> None:
        self.sock.send(b"-1")
        self.proc.wait(10)
        self.sock.close(0)
        self.fdsock.close()
        self.backend.free_range(self.rng)


def bench_fast(tenant, page_size: int, iters: int) -> dict:
    from kvpool.client_lib import ElasticBlockAllocator

    block = 16 << 10 if page_size >= 16 << 10 else page_size
    g = tenant.region_group(2, 64 * page_size, label="fast")
    a = ElasticBlockAllocator(g, block, background=False)
    keep = a.alloc(3 * a.blocks_per_chunk + 1)  # a few full chunks and a partial one
    spare = a.alloc(16)
    a.free(spare)
    alloc, free = a.alloc, a.free
    out = {}
    for n in (1, 16):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters // n):
                free(alloc(n))
            best.append((time.perf_counter() - t0) / (iters // n * n))
        out[n] = min(best) * 1e6
    assert a.slow_allocs == 1
    a.check_integrity()
    a.free(keep)
    a.close()
    g.close()
    return out


def bench_slow(tenant, floor: FloorClient, page_size: int, reps: dict[int, int]) -> dict:
    g = tenant.region_group(1, 64 * page_size, label="slow")
    base = g.ranges[0].base
    results = {}
    for n in BATCHES:
        units = list(range(n))
        daemon_t, floor_t = [], []
        for i in range(reps[n] + 3):
            t0 = time.perf_counter()
            g.grant(units)
            touch(g.backend, [base + u * page_size for u in units])
            t1 = time.perf_counter()
            g.release(units)
            t2 = time.perf_counter()
            floor.grant(n)
            t3 = time.perf_counter()
            floor.ungrant(n)
            if i >= 3:  # warm-up: first grants create pages, first maps fault page tables
                daemon_t.append(t1 - t0)
                floor_t.append(t3 - t2)
        d = statistics.median(daemon_t) / n * 1e6
        f = statistics.median(floor_t) / n * 1e6
        results[n] = {"daemon_us_per_page": d, "floor_us_per_page": f, "ratio": d / f,
                      "daemon_us_per_batch": d * n, "floor_us_per_batch": f * n,
                      "reps": reps[n]}
    g.close()
    return results


def versions() -> dict:
    import msgspec
    import zmq

    return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "msgspec": msgspec.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", default="2MiB")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    ap.add_argument("--floor-server", help=argparse.SUPPRESS)
    ap.add_argument("--floor-pages", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=["host", "cuda"], default="host",
                    help="the daemon's and the floor's memory backend")
    ap.add_argument("--metrics", action="store_true",
                    help="grant latency with vs without the Prometheus exporter (alloc_metrics.py)")
    ap.add_argument("--flood", type=int, default=0, metavar="N",
                    help="with --metrics: N threads scrape back to back (default: one, 10/s)")
    args = ap.parse_args()
    page_size = parse_size(args.page_size)
    if args.metrics:
        from alloc_metrics import run

        run(page_size, args.backend, 100 if args.quick else 400, args.out, args.flood)
        return
    if args.floor_server:
        floor_server(args.floor_server, page_size, args.floor_pages, args.backend)
        return

    from rich.console import Console
    from rich.table import Table

    from kvpool.client_lib import connect

    reps = {1: 60, 8: 30, 64: 15} if args.quick else {1: 300, 8: 150, 64: 60}
    fast_iters = 50_000 if args.quick else 200_000
    with tempfile.TemporaryDirectory(prefix="kvpbench-") as tmp, Cluster(Path(tmp)) as cluster:
        cluster.daemon(256 * page_size, page_size, extra=("--log-level", "WARNING"),
                       backend=args.backend)
        run_dir = str(cluster.run_dir)
        floor = FloorClient(run_dir, page_size, 64, args.backend)
        try:
            with connect(name="bench", run_dir=run_dir) as tenant:
                fast = bench_fast(tenant, page_size, fast_iters)
                slow = bench_slow(tenant, floor, page_size, reps)
        finally:
            floor.close()

    table = Table(title=f"kvpool allocation cost ({args.backend} backend, page "
                        f"{format_size(page_size)})")
    for col in ("path", "batch", "kvpool", "floor", "ratio", "goal"):
        table.add_column(col, justify="left" if col == "path" else "right")
    table.add_row("fast alloc+free", "1 block", f"{fast[1]:.2f} µs/block", "-", "-", "≤ 2 µs")
    table.add_row("fast alloc+free", "16 blocks", f"{fast[16]:.2f} µs/block", "-", "-", "≤ 2 µs")
    for n, r in slow.items():
        table.add_row("slow grant→mapped", f"{n} pages", f"{r['daemon_us_per_page']:.1f} µs/page",
                      f"{r['floor_us_per_page']:.1f} µs/page", f"{r['ratio']:.2f}x",
                      "≤ 1.5x" if n == 64 else "")
    Console(width=120).print(table)
    name = "alloc_bench" if args.backend == "host" else f"alloc_bench_{args.backend}"
    path = write_result(name, {
        "backend": args.backend,
        "versions": versions(),
        "page_size": page_size,
        "fast_path_us_per_block": {"alloc1_free": fast[1], "alloc16_free": fast[16]},
        "slow_path": {str(n): r for n, r in slow.items()},
        "goals": {"fast_path_us_per_block": 2.0, "slow_path_ratio_at_64": 1.5},
        "met": {"fast_path": fast[1] <= 2.0, "slow_path_64": slow[64]["ratio"] <= 1.5},
    }, args.out)
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
