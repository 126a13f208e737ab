"""What fresh pages cost: a page that changes tenant is a new physical page
(docs/ARCHITECTURE.md, "Fresh pages and retained memory"),
where it used to be the released one, zeroed. Recycled and fresh variants run
interleaved (A, B, A, B, ...) in one process, so both see the same machine state; each
row is reported as a ratio to its baseline.

* ``grant``: the daemon's part, ``Pool.take`` of one page — baseline: the tenant's own
  released page (recycled as is); fresh from the warm pool (what an idle daemon has
  ready); fresh created on the grant path (warm pool empty: retire + create).
* ``tenant``: the tenant's part, import + map with populate (first touch) of one page —
  baseline: a page that is resident already (recycled); the same page zeroed in place
  (the old way a page changed tenant); a fresh page (the kernel zero-fills it at first
  touch on host; on CUDA ``zero`` did at creation).
* ``idle``: what idle maintenance spends per released page — retire (with the
  still-referenced probe on host) + create a fresh warm page; baseline: the old scrub
  (``zero``, punch a hole / memset, and reuse).

    python benchmarks/fresh_pages_bench.py --backend host --rounds 200 --page-size 2MiB

Writes benchmarks/results/fresh_pages_bench_<backend>.json (or --out).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import summarize, write_result  # noqa: E402

from kvpool.daemon.pool import Pool  # noqa: E402
from kvpool.sizes import format_size, parse_size  # noqa: E402
from kvpool.vmm import open_backend  # noqa: E402


def ns(fn, *args):
    t0 = time.perf_counter_ns()
    out = fn(*args)
    return time.perf_counter_ns() - t0, out


def grant_side(pool: Pool, rounds: int) -> dict[str, list[int]]:
    """``take(1)`` of: the caller's own released page / a warm fresh page / a page
    created on the grant path after retiring another tenant's."""
    s: dict[str, list[int]] = {"recycled": [], "fresh_warm": [], "fresh_on_grant": []}
    for _ in range(rounds):
        # recycled: tenant 1 takes back what it released
        (pfn,) = pool.take(1, tenant=1)
        pool.give_back([pfn], tenant=1)
        t, got = ns(pool.take, 1, 1)
        s["recycled"].append(t)
        pool.give_back(got, tenant=1)
        # fresh, warm: idle maintenance made it ready
        while pool.has_work():
            pool.maintain(1.0)
        t, got = ns(pool.take, 1, 2)
        s["fresh_warm"].append(t)
        pool.give_back(got, tenant=2)
        # fresh on the grant path: warm pool empty, only tenant 2's dirty page left
        while pool.warm:
            pool._destroy(pool.warm.pop())
        t, got = ns(pool.take, 1, 3)
        s["fresh_on_grant"].append(t)
        pool.give_back(got, tenant=3)
        while pool.has_work():
            pool.maintain(1.0)
    return s


def tenant_side(b, rounds: int) -> dict[str, list[int]]:
    """import + map(populate) + unmap of one page: resident (recycled) vs fresh."""
    rng = b.reserve(b.page_size)
    resident = b.create_page()
    fd = b.export(resident)
    first = b.import_(fd)
    b.map(rng, 0, first, populate=True)  # fault it in once
    b.unmap(rng, 0)
    b.release(first)
    os.close(fd)
    s: dict[str, list[int]] = {"recycled": [], "zeroed_reused": [], "fresh": []}

    def cycle(page) -> int:
        fd = b.export(page)
        t0 = time.perf_counter_ns()
        imp = b.import_(fd)
        b.map(rng, 0, imp, populate=True)
        t = time.perf_counter_ns() - t0
        b.unmap(rng, 0)
        b.release(imp)
        os.close(fd)
        return t

    for _ in range(rounds):
        s["recycled"].append(cycle(resident))
        b.zero(resident)  # the old way a page changed tenant: zeroed in place
        s["zeroed_reused"].append(cycle(resident))
        page = b.create_page()
        if b.name != "host":
            b.zero(page)  # the pool zeroes device pages at creation, off the grant path
        s["fresh"].append(cycle(page))
        b.release(page)
    b.release(resident)
    b.free_range(rng)
    return s


def idle_side(b, rounds: int) -> dict[str, list[int]]:
    """Per released page: the old scrub (zero and reuse) vs retire + create fresh."""
    rng = b.reserve(b.page_size)
    s: dict[str, list[int]] = {"zero_and_reuse": [], "retire_and_create": []}

    def dirtied():
        page = b.create_page()
        b.map(rng, 0, page, populate=True)  # resident, as a released page is
        b.unmap(rng, 0)
        return page

    for _ in range(rounds):
        page = dirtied()
        t, _ = ns(b.zero, page)
        s["zero_and_reuse"].append(t)
        b.release(page)
        page = dirtied()
        t0 = time.perf_counter_ns()
        probe = b.retire(page)
        fresh = b.create_page()
        if b.name != "host":
            b.zero(fresh)
        s["retire_and_create"].append(time.perf_counter_ns() - t0)
        assert probe is None  # nobody else held it
        b.release(fresh)
    b.free_range(rng)
    return s


def table(title: str, s: dict[str, list[int]], baseline: str) -> tuple[Table, dict]:
    out = {k: summarize(v) for k, v in s.items()}
    base = out[baseline]["median_us"]
    for v in out.values():
        v["ratio_median"] = v["median_us"] / base if base else None
    t = Table(title=title)
    for col in ("variant", "n", "median µs", "p99 µs", "x baseline"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for k, v in out.items():
        t.add_row(k + (" (baseline)" if k == baseline else ""), str(v["n"]),
                  f"{v['median_us']:.1f}", f"{v['p99_us']:.1f}", f"{v['ratio_median']:.2f}")
    return t, out


@click.command()
@click.option("--backend", "kind", default="host", show_default=True)
@click.option("--rounds", default=200, show_default=True)
@click.option("--page-size", default="2MiB", show_default=True)
@click.option("--out", default=None)
def main(kind: str, rounds: int, page_size: str, out: str | None) -> None:
    b = open_backend(kind, page_size=parse_size(page_size))
    pool = Pool(b, budget_pages=8, warm_min=0, warm_max=4)
    console = Console()
    results = {}
    for name, fn, base in (("grant", lambda: grant_side(pool, rounds), "recycled"),
                           ("tenant", lambda: tenant_side(b, rounds), "recycled"),
                           ("idle", lambda: idle_side(b, rounds), "zero_and_reuse")):
        t, results[name] = table(f"{name} ({b.name}, page {format_size(b.page_size)})", fn(),
                                 base)
        console.print(t)
    pool.close()
    path = write_result(f"fresh_pages_bench_{b.name}", {
        "backend": b.name, "page_size": b.page_size, "rounds": rounds, "results": results,
    }, out)
    b.close()
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
