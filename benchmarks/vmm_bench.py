"""Per-operation cost of the vmm layer: create, export, import, map (with and without
populate), first touch, unmap, zero, release — over N pages, median and p99.

    python benchmarks/vmm_bench.py --backend host --pages 256 --page-size 2MiB

On CUDA it also times ``cuMemMap``, ``cuMemSetAccess`` and ``cuMemUnmap`` apart (the
published A100 figures: create 193 µs, map 1.5 µs, set access 36 µs, unmap 26 µs).

Writes benchmarks/results/vmm_bench_<backend>.json (or --out).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import summarize, write_result  # noqa: E402

from kvpool.client_lib.tensors import tensor_view  # noqa: E402
from kvpool.sizes import format_size, parse_size  # noqa: E402
from kvpool.vmm import open_backend  # noqa: E402


def timed(samples: dict, name: str, fn, *args):
    t0 = time.perf_counter_ns()
    out = fn(*args)
    samples.setdefault(name, []).append(time.perf_counter_ns() - t0)
    return out


def split_map(b, pages: list, s: dict) -> None:
    """CUDA only: ``cuMemMap``, ``cuMemSetAccess`` and ``cuMemUnmap`` timed apart, one page
    each, in a range of their own (``map_pages`` does map + set access in one call)."""
    from kvpool.vmm.cuda_driver import call as _call

    cu, ps = b._cu, b.page_size
    rng = b.reserve(len(pages) * ps)
    b._make_current("bench")
    for i, page in enumerate(pages):
        va = rng.base + i * ps
        timed(s, "cuMemMap", _call, cu, "bench", "cuMemMap", va, ps, 0, page.handle, 0)
        timed(s, "cuMemSetAccess", _call, cu, "bench", "cuMemSetAccess", va, ps, b._access, 1)
    _call(cu, "bench", "cuCtxSynchronize")
    for i in range(len(pages)):
        timed(s, "cuMemUnmap", _call, cu, "bench", "cuMemUnmap", rng.base + i * ps, ps)
    b.free_range(rng)


def run(backend_kind: str, npages: int, page_size: int, batch: int) -> dict:
    b = open_backend(backend_kind, page_size=page_size)
    cuda = b.name == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = b.reserve(2 * npages * b.page_size)
    s: dict[str, list[int]] = {}

    def touch(offset: int) -> None:
        view = tensor_view(b, rng, torch.uint8, offset=offset, nbytes=b.page_size)
        view.fill_(1)
        sync()

    pages = [timed(s, "create", b.create_page) for _ in range(npages)]
    fds = [timed(s, "export", b.export, p) for p in pages]
    imported = [timed(s, "import", b.import_, fd) for fd in fds]
    for fd in fds:
        os.close(fd)
    for p in imported:
        b.release(p)
    # first half: map lazily, then pay the first touch; second half: populate at map
    half = npages // 2
    for i in range(half):
        timed(s, "map", b.map, rng, i * b.page_size, pages[i])
    for i in range(half):
        timed(s, "first_touch", touch, i * b.page_size)
    for i in range(half, npages):
        timed(s, "map_populate", b.map, rng, i * b.page_size, pages[i], True)
    for i in range(half, npages):
        timed(s, "touch_after_populate", touch, i * b.page_size)
    for i in range(npages):
        timed(s, "unmap", b.unmap, rng, i * b.page_size)
    # batched map: one call for `batch` adjacent pages (cost reported per page)
    for start in range(0, npages - batch + 1, batch):
        t0 = time.perf_counter_ns()
        b.map_pages(rng, npages * b.page_size + start * b.page_size, pages[start : start + batch])
        per = (time.perf_counter_ns() - t0) // batch
        s.setdefault(f"map_batch{batch}_per_page", []).extend([per] * batch)
        t0 = time.perf_counter_ns()
        b.unmap(rng, npages * b.page_size + start * b.page_size, batch)
        per = (time.perf_counter_ns() - t0) // batch
        s.setdefault(f"unmap_batch{batch}_per_page", []).extend([per] * batch)
    if cuda:
        split_map(b, pages, s)
    for p in pages:
        timed(s, "zero", b.zero, p)
    for p in pages:
        timed(s, "release", b.release, p)
    t0 = time.perf_counter_ns()
    big = b.reserve(64 << 30)
    s["reserve_64GiB"] = [time.perf_counter_ns() - t0]
    b.free_range(big)
    b.free_range(rng)
    return {name: summarize(v) for name, v in s.items()}


@click.command()
@click.option("--backend", "backend_kind", type=click.Choice(["host", "cuda", "auto"]), default="host")
@click.option("--pages", "npages", default=256, show_default=True)
@click.option("--page-size", default="2MiB", show_default=True)
@click.option("--batch", default=64, show_default=True, help="pages per batched map call")
@click.option("--out", default=None, help="JSON path (default benchmarks/results/vmm_bench_<backend>.json)")
def main(backend_kind: str, npages: int, page_size: str, batch: int, out: str | None) -> None:
    size = parse_size(page_size)
    results = run(backend_kind, npages, size, batch)
    kind = open_backend(backend_kind, page_size=size).name
    table = Table(title=f"vmm ops, {kind} backend, {npages} pages of {format_size(size)} (µs)")
    for col in ("op", "median", "p99", "mean", "n"):
        table.add_column(col, justify="right" if col != "op" else "left")
    for name, r in results.items():
        table.add_row(name, f"{r['median_us']:.1f}", f"{r['p99_us']:.1f}", f"{r['mean_us']:.1f}", str(r["n"]))
    Console().print(table)
    payload = {"backend": kind, "pages": npages, "page_size": size, "batch": batch, "ops": results}
    path = write_result(f"vmm_bench_{kind}", payload, out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
