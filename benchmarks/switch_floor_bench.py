"""The rollout/train switch against the memcpy floor at sizes where bytes dominate
(issue 37's goal "switch each way <= 1.2x the memcpy floor of the bytes that must move").

``train_colocate_bench.py`` runs the whole RL loop on a 16 MiB budget, where 320 KiB
change owner per switch and the switch is bound by fixed costs (grant round trips, the
engine's shrink). This script keeps only the switch and makes the KV that changes owner
large (64 MiB .. 1 GiB), with real processes:

* a daemon (host backend) whose budget is the engine's KV plus what it keeps;
* an engine-shaped tenant process (this file, ``--engine``): an
  :class:`~kvpool.client_lib.ElasticBlockAllocator` over one region group, as the engine
  adapters use it (``populate=True``, the bundled engine's default), holding ``size +
  keep`` bytes of written KV blocks, idle (its prefix cache: evictable); its shrink
  callback evicts cached blocks as :class:`~kvpool.engine_adapters.elastic.ElasticPolicy`
  does, the library releases the emptied chunks. Not ``kvpool serve``: filling 1 GiB of
  real KV takes minutes of prefill per repetition on two CPU cores, and the switch sees
  only the allocator and the shrink callback;
* a trainer tenant (this process, :func:`~kvpool.client_lib.trainer.connect_trainer`)
  whose ``tr.step(size)`` needs exactly the engine's ``size`` bytes (the budget leaves
  nothing else free).

Per repetition, per configuration (interleaved: repetition k of every configuration and
the floor before repetition k+1 of any):

* **to train** — ``tr.step(size)`` from the request until the block runs: the daemon
  takes the idle engine's KV (shrink ask, eviction, release, zeroing), grants and the
  trainer maps the pages; **+touch**: the same plus one byte of every 4 KiB of the
  step's pages written (each OS page faulted in: a fresh page's zeroing is paid at its
  first touch on the host backend, so this is when the pages are really there);
* **to rollout** — from the step's end (the trainer gives its pages back) until the
  engine holds ``size`` bytes of KV again (``alloc`` of the blocks, a grant of free
  memory, mapped and populated: the bundled engine populates at map time); with
  ``--gap-ms`` the engine asks that long after the step's end (a publish between: the
  daemon's idle work renews the released pages meanwhile, into the warm pool up to
  ``--warm-max``), the gap not counted;
* **floor** — a plain ``torch`` copy of ``size`` bytes between two touched host buffers,
  measured in the same repetition (best of 3); beside it a ``torch`` zeroing of the same
  touched bytes (``memset``: what zeroing costs in user space);
* **kernel** — the same number of pages of the same backing straight from
  :class:`~kvpool.vmm.host.HostBackend`, no daemon (:func:`kernel_costs`): fresh pages
  faulted in (the kernel zeroes each at its first touch: what a page that changes owner
  costs at least, since it must be a fresh page), a populated mapping torn down, the
  memory freed, the pages created. Each daemon's ``kvpool check`` must be clean at the
  end (exit status 1 otherwise).

    /work/main/.venv/bin/python benchmarks/switch_floor_bench.py \
        [--sizes 64MiB,256MiB,1GiB] [--reps 7] [--backings shmem,hugetlb] \
        [--page-sizes 2MiB,4KiB] [--small-pages-upto 64MiB] [--gap-ms 0] \
        [--warm-max SIZE] \
        [--out benchmarks/results/switch_floor.json]

``shmem``: the host backend's default (memfd pages mapped with 4 KiB PTEs); ``hugetlb``:
``huge_pages = true`` (one PMD per 2 MiB page; huge pages borrowed as root for the run,
``vm.nr_hugepages`` restored after, else skipped saying why); hugetlb needs pages that
are multiples of 2 MiB. Page sizes under 2 MiB (the daemon's ``page_size``: every page is
its own memfd) run only up to ``--small-pages-upto``. The daemon runs with its default
warm pool settings. Prints a table and writes benchmarks/results/switch_floor.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

KEEP_FRACTION = 64  # the engine keeps size / 64 (its fair share covers it) besides


# ---- the engine-shaped tenant (a child process) ---------------------------------------
def engine(run_dir: str, page: int, size: int, keep: int) -> None:
    """Hold ``size + keep`` bytes of written KV, idle and evictable; ``grow`` (a line on
    stdin) allocates back up to ``size + keep`` and answers the seconds it took."""
    from kvpool.client_lib import ElasticBlockAllocator, connect

    t = connect(name="engine", run_dir=run_dir, shares=1.0)
    g = t.region_group(1, 2 * (size + keep))
    a = ElasticBlockAllocator(g, page, low=0, high=0, idle_timeout_s=3600, populate=True)
    lock = threading.Lock()
    cached: list[int] = []  # the prefix cache: evicted LRU-first by the shrink
    want = (size + keep) // page

    def shrink(nbytes: int, urgent: bool) -> None:
        with lock:
            k = min(len(cached) - keep // page, -(-nbytes // page))
            if k <= 0:
                return
            victims = cached[:k]
            del cached[:k]
        a.free(victims)

    t.set_shrink_callback(shrink)

    def grow() -> float:
        t0 = time.perf_counter()
        with lock:
            n = want - len(cached)
        if n > 0:
            got = a.alloc(n)
            if got is None:
                raise SystemExit(f"engine: {n} blocks not granted: {a.last_refusal}")
            with lock:
                cached.extend(got)
        return time.perf_counter() - t0

    grow()
    print(json.dumps({"ready": len(cached) * page}), flush=True)
    for line in sys.stdin:
        if line.strip() == "grow":
            s = grow()
            print(json.dumps({"grow_s": s, "held": len(cached) * page}), flush=True)
        elif line.strip() == "quit":
            break
    t.close()


# ---- the driver ------------------------------------------------------------------------
def memcpy_s(src: Any, dst: Any, reps: int = 3) -> float:
    """The best of ``reps`` plain copies of ``src`` into ``dst`` (host memory, torch)."""
    from common import best_s

    return best_s(lambda: dst.copy_(src), reps)


def memset_s(dst: Any, reps: int = 3) -> float:
    """The best of ``reps`` zeroings of ``dst`` (touched host memory, torch)."""
    from common import best_s

    return best_s(dst.zero_, reps)


def kernel_costs(size: int, page: int, backing: str) -> dict[str, float]:
    """What the kernel charges for ``size`` bytes of pages of this backing, no daemon, no
    tenant (:class:`~kvpool.vmm.host.HostBackend` directly, one process): ``create_s``
    the fresh pages made (a daemon's create on a grant path), ``fault_s`` them mapped and
    populated (every fresh page zeroed by the kernel at its first touch: the floor of a
    page that changes owner), ``unmap_s`` the populated mapping torn down (a giver's
    release), ``free_s`` the last descriptors closed (the memory freed: a daemon's
    retire)."""
    from kvpool.vmm.host import HostBackend

    b = HostBackend(page_size=page, huge_pages=backing == "hugetlb")
    try:
        n = size // page
        rng = b.reserve(size)
        t0 = time.perf_counter()
        pages = [b.create_page() for _ in range(n)]
        t1 = time.perf_counter()
        b.map_pages(rng, 0, pages, True)
        t2 = time.perf_counter()
        b.unmap(rng, 0, n)
        t3 = time.perf_counter()
        for pg in pages:
            b.release(pg)
        t4 = time.perf_counter()
        b.free_range(rng)
    finally:
        b.close()
    return {"create_s": t1 - t0, "fault_s": t2 - t1, "unmap_s": t3 - t2, "free_s": t4 - t3}


class Config:
    """One daemon, engine and trainer for one (size, page size, backing)."""

    def __init__(self, stack: contextlib.ExitStack, size: int, page: int, backing: str,
                 daemon_args: tuple[str, ...] = (), gap_s: float = 0.0):
        from kvpool import launch
        from kvpool.client_lib.trainer import connect_trainer

        self.size, self.page, self.backing = size, page, backing
        self.keep = max(page, (size // KEEP_FRACTION) // page * page)
        budget = size + self.keep
        run_dir = Path(tempfile.mkdtemp(prefix="kvp-switch-", dir="/tmp"))
        stack.callback(shutil.rmtree, run_dir, True)
        config = run_dir.with_suffix(".toml")
        config.write_text(f"huge_pages = {'true' if backing == 'hugetlb' else 'false'}\n")
        stack.callback(config.unlink, True)
        log = run_dir.with_suffix(".log")
        self.log = log
        self.gap_s = gap_s
        d = launch.start_daemon(run_dir, "--log-level", "WARNING", *daemon_args,
                                budget=budget, page_size=page, config=config, log=log,
                                cwd=REPO)
        stack.callback(d.stop)
        self.run_dir = run_dir
        self.eng = subprocess.Popen(
            [sys.executable, __file__, "--engine", str(run_dir), str(page), str(size),
             str(self.keep)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=REPO)
        stack.callback(self._stop_engine)
        ready = self._answer()
        assert ready["ready"] == budget, ready
        # the trainer's shares make the engine's fair share no more than what it keeps
        self.tr = stack.enter_context(connect_trainer(
            "trainer", run_dir=run_dir, shares=float(KEEP_FRACTION * 2), wait_s=60))
        self.samples: dict[str, list[float]] = {k: [] for k in (
            "to_train_s", "to_train_touch_s", "to_rollout_s", "engine_grow_s", "floor_s",
            "memset_s",
            "kernel_create_s", "kernel_fault_s", "kernel_unmap_s", "kernel_free_s")}
        self.problems: list[str] = []

    def _answer(self) -> dict[str, Any]:
        assert self.eng.stdout is not None
        line = self.eng.stdout.readline()
        if not line:
            raise SystemExit(f"the engine tenant died (daemon log {self.log})")
        out: dict[str, Any] = json.loads(line)
        return out

    def _stop_engine(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.eng.stdin is not None
            self.eng.stdin.write("quit\n")
            self.eng.stdin.close()
        try:
            self.eng.wait(30)
        except subprocess.TimeoutExpired:
            self.eng.kill()
            self.eng.wait()

    def cycle(self, touch: bool) -> None:
        """One switch each way (see the module); ``touch``: write the step's pages."""
        import torch

        s = self.samples
        t0 = time.perf_counter()
        with self.tr.step(self.size) as step:
            t1 = time.perf_counter()
            if touch:  # one byte of every 4 KiB written: each page faulted in (zeroed)
                v = self.tr.scratch.view(0, (self.size // 4096, 4096), torch.uint8)
                v[:, 0].fill_(1)
            t2 = time.perf_counter()
            held = self.tr.scratch.mapped_bytes
            assert held == self.size and step.nbytes == self.size, (held, step.nbytes)
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        if self.gap_s:  # the publish between the step and the next rollout (not counted)
            time.sleep(self.gap_s)
        assert self.eng.stdin is not None
        self.eng.stdin.write("grow\n")
        self.eng.stdin.flush()
        grown = self._answer()
        t5 = time.perf_counter()
        assert grown["held"] == self.size + self.keep, grown
        s["to_train_s"].append(t1 - t0)
        if touch:
            s["to_train_touch_s"].append(t2 - t0)
        s["to_rollout_s"].append(t5 - t3 - self.gap_s)
        s["engine_grow_s"].append(grown["grow_s"])
        _ = t4

    def floor(self, src: Any, dst: Any) -> None:
        self.samples["floor_s"].append(memcpy_s(src[:self.size], dst[:self.size]))
        self.samples["memset_s"].append(memset_s(dst[:self.size]))
        for k, v in kernel_costs(self.size, self.page, self.backing).items():
            self.samples[f"kernel_{k}"].append(v)

    def check(self) -> None:
        """``kvpool check`` of this daemon (empty: clean)."""
        from kvpool.client_lib import Monitor

        with Monitor(self.run_dir) as m:
            self.problems = list(m.check())

    def summary(self) -> dict[str, Any]:
        med = {k: statistics.median(v) if v else None for k, v in self.samples.items()}
        fl = med["floor_s"]
        return {
            "size": self.size, "page_size": self.page, "backing": self.backing,
            "engine_keeps": self.keep, "reps": len(self.samples["floor_s"]),
            **{f"median_{k}": v for k, v in med.items()},
            "ratio_to_train": med["to_train_s"] / fl,
            "ratio_to_train_touch": (med["to_train_touch_s"] / fl
                                     if med["to_train_touch_s"] is not None else None),
            "ratio_to_rollout": med["to_rollout_s"] / fl,
            "ratio_fresh_fault": med["kernel_fault_s"] / fl,
            "ratio_memset": med["memset_s"] / fl,
            "check": self.problems,
            "samples": self.samples,
        }


@contextlib.contextmanager
def huge_pages_for(backings: list[str], nbytes: int) -> Iterator[str | None]:
    if "hugetlb" not in backings:
        yield None
        return
    from kvpool.vmm import hugetlb

    try:
        with hugetlb.borrowed(nbytes):
            # a huge page's first fault after the pool grew costs ~10-20x a later one
            # (measured: 64 MiB 136 ms, then 6 ms): every free one faulted once first
            hp = hugetlb.huge_page_size() or 2 << 20
            kernel_costs(hugetlb.free_pages() * hp, hp, "hugetlb")
            yield None
    except hugetlb.NoHugePages as e:
        yield str(e)


def fmt_size(n: int) -> str:
    from kvpool.sizes import format_size

    return format_size(n)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| KV moved | page | backing | to train ms | +touch ms | to rollout ms | "
             "floor ms | ratio to train | ratio +touch | ratio to rollout | kernel: fresh "
             "fault / unmap / free / create ms | memset ms |",
             "|" + "---|" * 12]
    for r in rows:
        def ms(k: str) -> str:
            v = r[f"median_{k}"]
            return "—" if v is None else f"{1e3 * v:.1f}"
        rt = r["ratio_to_train_touch"]
        lines.append(
            f"| {fmt_size(r['size'])} | {fmt_size(r['page_size'])} | {r['backing']} | "
            f"{ms('to_train_s')} | {ms('to_train_touch_s')} | {ms('to_rollout_s')} | "
            f"{ms('floor_s')} | {r['ratio_to_train']:.2f}x | "
            f"{'—' if rt is None else f'{rt:.2f}x'} | {r['ratio_to_rollout']:.2f}x | "
            f"{ms('kernel_fault_s')} ({r['ratio_fresh_fault']:.2f}x) / {ms('kernel_unmap_s')}"
            f" / {ms('kernel_free_s')} / {ms('kernel_create_s')} | {ms('memset_s')} "
            f"({r['ratio_memset']:.2f}x) |")
    return "\n".join(lines)


def main() -> int:
    from common import RESULTS, write_result

    from kvpool.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64MiB,256MiB,1GiB")
    ap.add_argument("--page-sizes", default="2MiB,4KiB")
    ap.add_argument("--backings", default="shmem,hugetlb")
    ap.add_argument("--small-pages-upto", default="64MiB",
                    help="page sizes under 2 MiB run only for sizes up to this (each page "
                         "costs the same fixed work: 1 GiB of 4 KiB pages is 262,144 pages)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="idle time between the step's end and the engine's regrowth (a "
                         "publish), not counted in to rollout")
    ap.add_argument("--warm-max", default=None,
                    help="the daemon's warm_max (default: its own, 256MiB)")
    ap.add_argument("--no-touch", action="store_true",
                    help="do not time the trainer's first write of its step pages")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
        pages = [parse_size(s) for s in args.page_sizes.split(",") if s]
        small_upto = parse_size(args.small_pages_upto)
    except ValueError as e:
        print(f"switch_floor_bench: {e}", file=sys.stderr)
        return 2
    backings = [b for b in args.backings.split(",") if b]
    bad = [b for b in backings if b not in ("shmem", "hugetlb")]
    if bad or not backings or not sizes or not pages or args.reps < 1 or args.gap_ms < 0:
        print("switch_floor_bench: --backings from shmem,hugetlb; --sizes, --page-sizes "
              "non-empty; --reps >= 1; --gap-ms >= 0", file=sys.stderr)
        return 2
    odd = [s for s in sizes for p in pages if s % p or s < 4 * p]
    if odd:
        print(f"switch_floor_bench: every size must be a multiple of every page size and "
              f"at least 4 pages ({fmt_size(odd[0])})", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    big = max(sizes)
    skipped: dict[str, str] = {}
    t_start = time.monotonic()
    # every daemon's budget, and the kernel-cost pages of the largest size besides
    need_huge = sum(s + max(max(pages), s // KEEP_FRACTION) for s in sizes) + big + (64 << 20)
    with huge_pages_for(backings, need_huge) as why, contextlib.ExitStack() as stack:
        if why is not None:
            skipped["hugetlb"] = why
            backings = [b for b in backings if b != "hugetlb"]
            print(f"hugetlb skipped: {why}", flush=True)
        dargs = ("--warm-max", args.warm_max) if args.warm_max else ()
        confs = [Config(stack, s, p, b, dargs, args.gap_ms / 1e3)
                 for b in backings for p in pages for s in sizes
                 if not (b == "hugetlb" and p % (2 << 20))
                 and not (p < (2 << 20) and s > small_upto)]
        src = torch.ones(big, dtype=torch.uint8)
        dst = torch.zeros(big, dtype=torch.uint8)
        for k in range(args.reps):
            for c in confs:
                c.cycle(touch=not args.no_touch)
                c.floor(src, dst)
            print(f"rep {k + 1}/{args.reps}: " + "  ".join(
                f"{fmt_size(c.size)}/{c.backing} {1e3 * c.samples['to_train_s'][-1]:.0f}/"
                f"{1e3 * c.samples['to_rollout_s'][-1]:.0f}ms (floor "
                f"{1e3 * c.samples['floor_s'][-1]:.0f})" for c in confs), flush=True)
        for c in confs:
            c.check()
        rows = [c.summary() for c in confs]
    text = table(rows)
    print(text)
    out = Path(args.out) if args.out else RESULTS / "switch_floor.json"
    path = write_result("switch_floor", {
        "reps": args.reps, "seconds": time.monotonic() - t_start, "skipped": skipped,
        "gap_ms": args.gap_ms, "warm_max": args.warm_max,
        "table": text, "rows": rows}, str(out))
    print(f"wrote {path}")
    bad_checks = {f"{fmt_size(r['size'])}/{fmt_size(r['page_size'])}/{r['backing']}":
                  r["check"] for r in rows if r["check"]}
    if bad_checks:
        print(f"kvpool check found problems: {bad_checks}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main())
