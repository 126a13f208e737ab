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
run against one daemon per layout and backing (host backend, 2 MiB pages, started by
:mod:`kvpool.launch`). Both tenants live in this process (two sessions); the giver polls
its own connection for the daemon's word instead of waiting for its keeper thread's
20 ms tick. ``giver_unmap`` is the giver's own unmap calls on their own (timed inside
its backend), the part of ``kvpool`` (done) that the page tables cost.

Backings (``--backing``): ``shmem`` — the default memfd pages, 512 4 KiB PTEs per 2 MiB
page (unless THP for shmem is on); ``hugetlb`` — the daemon's ``huge_pages = true``,
one PMD per page. For ``hugetlb`` the huge pages must be free: those free are used, or
(as root) ``vm.nr_hugepages`` is raised for the run and always restored; otherwise the
backing is skipped with the reason printed.

    .venv/bin/python benchmarks/handoff_bench.py [--reps 7] [--tokens 256,2048,16384]
        [--layouts per_layer,block_major] [--backing shmem,hugetlb]
        [--out benchmarks/results/handoff.json]

Prints a table and writes benchmarks/results/handoff.json.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import summarize, write_result  # noqa: E402

from kvpool import launch  # noqa: E402
from kvpool.vmm import hugetlb  # noqa: E402

PAGE = 2 << 20
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 128 KiB


def layout(name: str) -> tuple[int, int]:
    """(regions, tokens per unit) of the KV layout."""
    if name == "per_layer":
        return 2 * LAYERS, PAGE // (KV_HEADS * HEAD_DIM * DTYPE_BYTES)
    return 1, PAGE // TOKEN_BYTES


@contextlib.contextmanager
def daemon(budget: int, backing: str) -> Iterator[Path]:
    """A host daemon (``huge_pages = true`` for ``hugetlb``) on a fresh run dir."""
    run_dir = Path(tempfile.mkdtemp(prefix="kvp-handoff-", dir="/tmp"))
    config = run_dir.with_suffix(".toml")
    config.write_text(f"huge_pages = {'true' if backing == 'hugetlb' else 'false'}\n")
    log = run_dir.with_suffix(".log")
    try:
        d = launch.start_daemon(run_dir, "--warm-max", "0", budget=budget, page_size=PAGE,
                                config=config, log=log, cwd=REPO)
    except launch.DaemonStartError as e:
        raise SystemExit(f"the daemon did not start: {e}") from None
    try:
        yield run_dir
    finally:
        d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
        config.unlink(missing_ok=True)


@contextlib.contextmanager
def backing_pages(backing: str, budget: int) -> Iterator[str | None]:
    """Yields None when ``backing`` can run (huge pages free for ``budget``, borrowed
    as root if need be and given back after), else the reason it cannot."""
    if backing != "hugetlb":
        yield None
        return
    try:
        with hugetlb.borrowed(budget):
            yield None
    except hugetlb.NoHugePages as e:
        yield str(e)


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
        self.unmap_ns: list[int] = []  # the giver's unmap calls, per handoff
        self._unmapping = 0
        backend = self.gg.backend
        unmap = backend.unmap

        def timed_unmap(*args, **kw):  # the giver's page-table teardown, on its own
            t0 = time.perf_counter_ns()
            try:
                return unmap(*args, **kw)
            finally:
                self._unmapping += time.perf_counter_ns() - t0

        backend.unmap = timed_unmap  # type: ignore[method-assign]

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

        self._unmapping = 0
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
        self.unmap_ns.append(self._unmapping)
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


def measure(name: str, sizes: list[int], reps: int, cuda: bool, backing: str) -> dict:
    """Every size of one layout, ``reps`` interleaved repetitions, one daemon."""
    regions, per_unit = layout(name)
    units_of = {n: -(-n // per_unit) for n in sizes}
    most = max(units_of.values())
    budget = (most * regions + 8) * PAGE
    kinds = ["kvpool_ready", "kvpool", "giver_unmap", "host_copy", "kvpool_touch",
             "copy_touch"]
    kinds += ["cuda_copy"] if cuda else []
    samples: dict[int, dict[str, list[int]]] = {n: {k: [] for k in kinds} for n in sizes}
    with backing_pages(backing, budget) as skip:
        if skip:
            print(f"{name}/{backing}: skipped: {skip}", file=sys.stderr)
            return {"layout": name, "backing": backing, "skipped": skip}
        with daemon(budget, backing) as run_dir:
            pair = Pair(run_dir, regions, most)
            try:
                for rep in range(reps):
                    one_rep(pair, sizes, units_of, rep, cuda, samples)
                    print(f"{name}/{backing}: rep {rep + 1}/{reps} done", file=sys.stderr)
            finally:
                pair.close()
    rows = []
    for n in sizes:
        units = units_of[n]
        row: dict = {"tokens": n, "kv_bytes": n * TOKEN_BYTES, "units": units,
                     "pages": units * regions, "unit_bytes_mapped": units * regions * PAGE}
        for what, xs in samples[n].items():
            row[what] = summarize(xs)
        med = {k: statistics.median(xs) for k, xs in samples[n].items()}
        row["host_copy_over_kvpool"] = med["host_copy"] / med["kvpool"]
        row["host_copy_over_kvpool_ready"] = med["host_copy"] / med["kvpool_ready"]
        row["giver_unmap_share_of_kvpool"] = med["giver_unmap"] / med["kvpool"]
        if cuda:
            row["cuda_copy_over_kvpool"] = med["cuda_copy"] / med["kvpool"]
        for what in ("kvpool", "kvpool_ready", "giver_unmap", "kvpool_touch"):
            row[f"{what}_us_per_page"] = med[what] / 1e3 / row["pages"]
        rows.append(row)
    return {"layout": name, "backing": backing, "regions": regions,
            "tokens_per_unit": per_unit, "rows": rows}


def one_rep(pair: Pair, sizes: list[int], units_of: dict[int, int], rep: int, cuda: bool,
            samples: dict[int, dict[str, list[int]]]) -> None:
    """One repetition of every size: the handoff and the copies, order alternating."""
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
                ready, done = pair.handoff(units, stamp, nbytes // pair.regions)
                samples[n]["kvpool_ready"].append(ready)
                samples[n]["kvpool"].append(done)
                samples[n]["giver_unmap"].append(pair.unmap_ns[-1])
            else:
                samples[n][what].append(copies[what].run())
                if what == "host_copy":
                    samples[n]["copy_touch"].append(copies[what].touch_ns)
        samples[n]["kvpool_touch"].append(pair.touch_ns[-1])
        del copies


def show(result: dict, reps: int, cuda: bool) -> None:
    if "skipped" in result:
        print(f"\nlayout {result['layout']}, {result['backing']}: skipped ({result['skipped']})")
        return
    print(f"\nlayout {result['layout']}, {result['backing']} pages: {result['regions']} "
          f"regions, {result['tokens_per_unit']} tokens per unit, {TOKEN_BYTES >> 10} KiB KV "
          f"per token; medians of {reps} interleaved reps (ms; us/page: per 2 MiB page)")
    print(f"{'tokens':>7} {'KV MiB':>7} {'pages':>6} {'ready':>8} {'done':>8} "
          f"{'unmap':>8} {'copy':>8} {'copy/ready':>10} {'copy/done':>9} "
          f"{'us/page ready/done/unmap':>25} {'touch kvpool/copy':>18}"
          + (f" {'cuda copy':>9} {'cuda/done':>9}" if cuda else ""))
    for r in result["rows"]:
        ms = {k: r[k]["median_us"] / 1e3 for k in ("kvpool_ready", "kvpool", "giver_unmap",
                                                    "host_copy", "kvpool_touch", "copy_touch")}
        per_page = (f"{r['kvpool_ready_us_per_page']:.1f} / {r['kvpool_us_per_page']:.1f} / "
                    f"{r['giver_unmap_us_per_page']:.1f}")
        line = (f"{r['tokens']:>7} {r['kv_bytes'] / 2**20:>7.0f} {r['pages']:>6} "
                f"{ms['kvpool_ready']:>8.2f} {ms['kvpool']:>8.2f} {ms['giver_unmap']:>8.2f} "
                f"{ms['host_copy']:>8.2f} {r['host_copy_over_kvpool_ready']:>9.2f}x "
                f"{r['host_copy_over_kvpool']:>8.2f}x {per_page:>25} "
                f"{ms['kvpool_touch']:>8.2f} / {ms['copy_touch']:<7.2f}")
        if cuda:
            line += (f" {r['cuda_copy']['median_us'] / 1e3:>9.2f} "
                     f"{r['cuda_copy_over_kvpool']:>8.2f}x")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", default="256,2048,16384")
    ap.add_argument("--layouts", default="per_layer,block_major")
    ap.add_argument("--backing", default="shmem,hugetlb",
                    help="page memory: shmem (memfd, 4 KiB PTEs), hugetlb (huge_pages = true)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.tokens.split(",")]
    except ValueError:
        raise SystemExit(f"--tokens: expected numbers separated by commas, got {args.tokens!r}")
    names = [x for x in args.layouts.split(",") if x]
    bad = [x for x in names if x not in ("per_layer", "block_major")]
    if bad:
        raise SystemExit(f"unknown layout {bad[0]!r} (per_layer, block_major)")
    backings = [x for x in args.backing.split(",") if x]
    bad = [x for x in backings if x not in ("shmem", "hugetlb")] or ([] if backings else [""])
    if bad:
        raise SystemExit(f"--backing: unknown backing {bad[0]!r} (shmem, hugetlb)")
    cuda = cuda_available()
    results = [measure(name, sizes, args.reps, cuda, b) for name in names for b in backings]
    for result in results:
        show(result, args.reps, cuda)
    path = write_result("handoff", {
        "what": "request KV handed from one tenant to another through kvpool (ready: "
                "offer + claim + the receiver reads a word of every page; done: the giver "
                "has unmapped them too; giver_unmap: the giver's unmap calls alone) vs "
                "copying the KV bytes (host memcpy floor; CUDA device-to-device when "
                "present); touch: the receiver's first read of every 4 KiB afterwards "
                "(minor faults on host: 512 per page on shmem, 1 on hugetlb) vs the same "
                "reads of the copy; per backing: shmem memfd pages (4 KiB PTEs) or hugetlb "
                "(daemon huge_pages = true)",
        "model": {"like": "Llama-3-8B", "layers": LAYERS, "kv_heads": KV_HEADS,
                  "head_dim": HEAD_DIM, "dtype_bytes": DTYPE_BYTES, "token_bytes": TOKEN_BYTES,
                  "page_size": PAGE},
        "backend": "host", "backings": backings, "reps": args.reps, "cuda": cuda,
        "thp_shmem_enabled": thp_shmem(), "layouts": results,
    }, args.out)
    print(f"wrote {os.path.relpath(path)}")


def thp_shmem() -> str:
    """The kernel's shmem THP policy (``never``: shmem pages are mapped 4 KiB at a time)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
