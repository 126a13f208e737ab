"""Handing a request's KV cache to another tenant through kvpool vs copying its bytes.

A request's KV of 256 / 2,048 / 16,384 tokens for a Llama-3-8B-like layout (32 layers,
8 KV heads x 128 dims, fp16: 128 KiB per token; layout ``per_layer``: 64 regions,
one per layer and K/V, 2 KiB per token per region, 1,024 tokens per unit of 64 pages;
``block_major``: one region, 16 tokens per 2 MiB page) is moved from a *giver* tenant to a
*receiver* tenant:

* **kvpool handoff** — ``offer`` (giver) + ``claim`` (receiver: descriptors received and
  mapped) + the receiver reads one word of every page it got (checked against what the
  giver wrote) + the giver has heard the claim and unmapped the units. No byte copied;
  the request occupies whole units (request-aligned KV: at most one partly used unit);
  Reported apart: the receiver's first read of every 4 KiB afterwards (``kvpool_touch``:
  minor faults of the lazy host mapping; ``copy_touch``: the same reads of the copy's
  pre-faulted destination), which a copy-based receiver does not pay;
* **copy baseline** — copying the same KV bytes between two pre-faulted host buffers
  (``numpy.copyto``: the memcpy floor of any copy-based transfer on one host), and on
  CUDA (``torch.cuda.is_available()``) a device-to-device ``Tensor.copy_`` as well.

Repetitions are interleaved (every size, kvpool then copies, order alternating) in one
run against one daemon (host backend, 2 MiB pages). Both tenants live in this process
(two sessions); the giver polls its own connection for the daemon's word instead of
waiting for its keeper thread's 20 ms tick.

    .venv/bin/python benchmarks/handoff_bench.py [--reps 7] [--tokens 256,2048,16384]
        [--layouts per_layer,block_major] [--out benchmarks/results/handoff.json]

Prints a table and writes benchmarks/results/handoff.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
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

PAGE = 2 << 20
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 128 KiB


def layout(name: str) -> tuple[int, int]:
    """(regions, tokens per unit) of the KV layout."""
    if name == "per_layer":
        return 2 * LAYERS, PAGE // (KV_HEADS * HEAD_DIM * DTYPE_BYTES)
    return 1, PAGE // TOKEN_BYTES


def start_daemon(budget: int) -> tuple[subprocess.Popen, Path]:
    run_dir = Path(tempfile.mkdtemp(prefix="kvp-handoff-", dir="/tmp"))
    log = open(run_dir.with_suffix(".log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "daemon", "--backend", "host",
         "--run-dir", str(run_dir), "--budget", str(budget), "--page-size", str(PAGE),
         "--warm-max", "0"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 30
    while not (run_dir / "control.sock").exists() or not (run_dir / "pages.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not start: {run_dir.with_suffix('.log').read_text()}")
        time.sleep(0.05)
    return proc, run_dir


class Pair:
    """A giver and a receiver tenant, each with one group of the layout."""

    def __init__(self, run_dir: Path, regions: int, units: int):
        from kvpool.client_lib.tenant import Tenant

        self.giver = Tenant("prefill", run_dir=run_dir, keeper=False)
        self.receiver = Tenant("decode", run_dir=run_dir, keeper=False)
        cap = units * PAGE
        self.gg = self.giver.region_group(regions, cap, label="prefill-kv")
        self.rg = self.receiver.region_group(regions, cap, label="decode-kv")
        self.regions = regions
        self.touch_ns: list[int] = []  # the receiver's first read of every 4 KiB, after

    def prepare(self, units: int, stamp: int) -> None:
        """The giver holds ``units`` fresh units written end to end (a prefilled KV)."""
        self.gg.grant(range(units), populate=True)
        for r in range(self.regions):
            for u in range(units):
                addr = self.gg.unit_address(r, u)
                ctypes.memset(addr, (stamp + r + u) & 0xFF, PAGE)
                ctypes.c_uint64.from_address(addr).value = stamp << 32 | r << 16 | u

    def handoff(self, units: int, stamp: int, kv_bytes: int) -> tuple[int, int]:
        """Nanoseconds until the receiver reads every page (offer + claim + reads), and
        until the giver has unmapped them too (the giver's side runs after the claim)."""
        from kvpool.client_lib import handoff

        t0 = time.perf_counter_ns()
        ticket = handoff.offer(self.gg, range(units), to="decode", ttl_s=60)
        at = list(range(units))
        handoff.claim(self.rg, ticket.id, at)
        for r in range(self.regions):
            for u in at:
                got = ctypes.c_uint64.from_address(self.rg.unit_address(r, u)).value
                if got != stamp << 32 | r << 16 | u:
                    raise SystemExit(f"region {r} unit {u}: read {got:#x}")
        ready = time.perf_counter_ns() - t0
        while not ticket.settled:
            self.giver.poll()
        done = time.perf_counter_ns() - t0
        self.touch_ns.append(touch_every_os_page(
            [(self.rg.unit_address(r, 0), kv_bytes) for r in range(self.regions)]))
        if ticket.state != "claimed" or self.gg.mapped:
            raise SystemExit(f"the giver still maps {sorted(self.gg.mapped)} ({ticket.state})")
        self.rg.release(at)
        return ready, done

    def close(self) -> None:
        self.giver.close()
        self.receiver.close()


def touch_every_os_page(spans: list[tuple[int, int]]) -> int:
    """Read one byte of every 4 KiB of the spans (address, bytes); nanoseconds. After a
    handoff on host each first touch is a minor fault (the mapping is lazy); on the copy's
    pre-faulted destination it is a cache miss only."""
    import numpy as np

    t0 = time.perf_counter_ns()
    for addr, n in spans:
        view = np.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=np.uint8)
        int(view[::4096].sum())
    return time.perf_counter_ns() - t0


class HostCopy:
    def __init__(self, nbytes: int):
        import numpy as np

        self.src = np.full(nbytes, 7, dtype=np.uint8)
        self.dst = np.ones(nbytes, dtype=np.uint8)  # both pre-faulted

    def run(self) -> int:
        import numpy as np

        t0 = time.perf_counter_ns()
        np.copyto(self.dst, self.src)
        took = time.perf_counter_ns() - t0
        self.touch_ns = touch_every_os_page([(self.dst.ctypes.data, self.dst.nbytes)])
        return took


class CudaCopy:
    def __init__(self, nbytes: int):
        import torch

        self.torch = torch
        self.src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        torch.cuda.synchronize()

    def run(self) -> int:
        t0 = time.perf_counter_ns()
        self.dst.copy_(self.src)
        self.torch.cuda.synchronize()
        return time.perf_counter_ns() - t0


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def measure(name: str, sizes: list[int], reps: int, cuda: bool) -> dict:
    """Every size of one layout, ``reps`` interleaved repetitions, one daemon."""
    regions, per_unit = layout(name)
    units_of = {n: -(-n // per_unit) for n in sizes}
    most = max(units_of.values())
    proc, run_dir = start_daemon(budget=(most * regions + 8) * PAGE)
    kinds = ["kvpool_ready", "kvpool", "host_copy", "kvpool_touch", "copy_touch"]
    kinds += ["cuda_copy"] if cuda else []
    samples = {n: {k: [] for k in kinds} for n in sizes}
    try:
        pair = Pair(run_dir, regions, most)
        for rep in range(reps):
            for n in sizes:
                units, nbytes = units_of[n], n * TOKEN_BYTES
                copies: dict = {"host_copy": HostCopy(nbytes)}
                if cuda:
                    copies["cuda_copy"] = CudaCopy(nbytes)
                stamp = rep * 1000 + n % 997
                pair.prepare(units, stamp)
                order = ["kvpool", *copies] if rep % 2 == 0 else [*copies, "kvpool"]
                for what in order:
                    if what == "kvpool":  # (the request's KV bytes, per region, touched)
                        ready, done = pair.handoff(units, stamp, nbytes // regions)
                        samples[n]["kvpool_ready"].append(ready)
                        samples[n]["kvpool"].append(done)
                    else:
                        samples[n][what].append(copies[what].run())
                        if what == "host_copy":
                            samples[n]["copy_touch"].append(copies[what].touch_ns)
                samples[n]["kvpool_touch"].append(pair.touch_ns.pop())
                del copies
            print(f"{name}: rep {rep + 1}/{reps} done", file=sys.stderr)
        pair.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.with_suffix(".log").unlink(missing_ok=True)
    rows = []
    for n in sizes:
        units = units_of[n]
        row: dict = {"tokens": n, "kv_bytes": n * TOKEN_BYTES, "units": units,
                     "pages": units * regions, "unit_bytes_mapped": units * regions * PAGE}
        for what, xs in samples[n].items():
            row[what] = summarize(xs)
        kv = statistics.median(samples[n]["kvpool"])
        ready = statistics.median(samples[n]["kvpool_ready"])
        host = statistics.median(samples[n]["host_copy"])
        row["host_copy_over_kvpool"] = host / kv
        row["host_copy_over_kvpool_ready"] = host / ready
        if cuda:
            row["cuda_copy_over_kvpool"] = statistics.median(samples[n]["cuda_copy"]) / kv
        row["kvpool_us_per_page"] = kv / 1e3 / row["pages"]
        row["kvpool_ready_us_per_page"] = ready / 1e3 / row["pages"]
        rows.append(row)
    return {"layout": name, "regions": regions, "tokens_per_unit": per_unit, "rows": rows}


def show(result: dict, reps: int, cuda: bool) -> None:
    print(f"\nlayout {result['layout']}: {result['regions']} regions, "
          f"{result['tokens_per_unit']} tokens per unit, {TOKEN_BYTES >> 10} KiB KV per "
          f"token; medians of {reps} interleaved reps")
    print(f"{'tokens':>7} {'KV MiB':>8} {'pages':>6} {'ready ms':>9} {'done ms':>8} "
          f"{'host copy ms':>13} {'copy/ready':>11} {'copy/done':>10} "
          f"{'touch ms kvpool/copy':>21}" + (f" {'cuda copy ms':>13} {'cuda/done':>10}"
                                             if cuda else ""))
    for r in result["rows"]:
        line = (f"{r['tokens']:>7} {r['kv_bytes'] / 2**20:>8.0f} {r['pages']:>6} "
                f"{r['kvpool_ready']['median_us'] / 1e3:>9.2f} "
                f"{r['kvpool']['median_us'] / 1e3:>8.2f} {r['host_copy']['median_us'] / 1e3:>13.2f} "
                f"{r['host_copy_over_kvpool_ready']:>10.2f}x {r['host_copy_over_kvpool']:>9.2f}x "
                f"{r['kvpool_touch']['median_us'] / 1e3:>12.2f} / "
                f"{r['copy_touch']['median_us'] / 1e3:<6.2f}")
        if cuda:
            line += (f" {r['cuda_copy']['median_us'] / 1e3:>13.2f} "
                     f"{r['cuda_copy_over_kvpool']:>9.2f}x")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", default="256,2048,16384")
    ap.add_argument("--layouts", default="per_layer,block_major")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in args.tokens.split(",")]
    names = [x for x in args.layouts.split(",") if x]
    bad = [x for x in names if x not in ("per_layer", "block_major")]
    if bad:
        raise SystemExit(f"unknown layout {bad[0]!r} (per_layer, block_major)")
    cuda = cuda_available()
    results = [measure(name, sizes, args.reps, cuda) for name in names]
    for result in results:
        show(result, args.reps, cuda)
    path = write_result("handoff", {
        "what": "request KV handed from one tenant to another through kvpool (ready: "
                "offer + claim + the receiver reads a word of every page; done: the giver "
                "has unmapped them too) vs copying the KV bytes (host memcpy floor; CUDA "
                "device-to-device when present); touch: the receiver's first read of every "
                "4 KiB afterwards (minor faults on host) vs the same reads of the copy",
        "model": {"like": "Llama-3-8B", "layers": LAYERS, "kv_heads": KV_HEADS,
                  "head_dim": HEAD_DIM, "dtype_bytes": DTYPE_BYTES, "token_bytes": TOKEN_BYTES,
                  "page_size": PAGE},
        "backend": "host", "reps": args.reps, "cuda": cuda, "layouts": results,
    }, args.out)
    print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
