"""The headline figures of a gpu_check.sh run, one line each, from its results/*.json.

    python scripts/gpu_figures.py RESULTS_DIR

So the numbers show in the run's output (and summary.txt) without fetching any file.
A missing or partial result prints what it has; never raises (standard library only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(d: Path, stem: str) -> dict | None:
    for name in (f"{stem}_cuda.json", f"{stem}_host.json", f"{stem}.json"):
        try:
            return json.loads((d / name).read_text())
        except (OSError, ValueError):
            continue
    return None


def _us(ops: dict, name: str) -> str:
    r = ops.get(name)
    return f"{name} {r['median_us']:.1f}/{r['p99_us']:.1f}" if r else f"{name} -"


def vmm(doc: dict) -> str:
    ops = doc.get("ops", {})
    names = ("create", "export", "import", "map", "cuMemMap", "cuMemSetAccess", "unmap",
             "cuMemUnmap", "zero", "release")
    return "vmm µs median/p99 per page: " + ", ".join(_us(ops, n) for n in names if n in ops)


def alloc(doc: dict) -> str:
    fast = doc.get("fast_path_us_per_block", {})
    slow = doc.get("slow_path", {})
    parts = [f"fast {fast.get('alloc1_free', float('nan')):.2f} µs/block"]
    for n, r in slow.items():
        parts.append(f"slow x{n} {r['daemon_us_per_page']:.0f} µs/page = {r['ratio']:.2f}x floor")
    return "alloc: " + ", ".join(parts)


def daemon(doc: dict) -> str:
    checks = doc.get("checks", {})
    parts = [f"{k} {'pass' if v.get('ok') else 'FAIL'}" for k, v in checks.items()]
    kill = checks.get("kill_frees_memory", {})
    if kill.get("memory_back_s") is not None:
        parts.append(f"memory back in {kill['memory_back_s']:.2f}s")
    return "daemon: " + ", ".join(parts)


def engine(doc: dict) -> str:
    parts = [f"{r['layout']} b{r['batch']} {r['ratio']:.3f} "
             f"({r.get('tokens_per_s', {}).get('elastic', 0):.0f} tok/s)"
             for r in doc.get("results", [])]
    eff = doc.get("layout_effect_block_major_over_per_layer") or {}
    if eff:
        parts.append("block_major/per_layer " + " ".join(f"b{b} {v:.3f}" for b, v in eff.items()))
    return "engine elastic/static: " + ", ".join(parts)


def demo(doc: dict) -> str:
    keys = ("ttft_p99_static_over_elastic", "ttft_mean_static_over_elastic")
    return "demo TTFT static/elastic: " + ", ".join(
        f"{k.split('_')[1]} {doc[k]:.2f}x" for k in keys if k in doc)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: gpu_figures.py RESULTS_DIR", file=sys.stderr)
        return 2
    d = Path(argv[0])
    for stem, fmt in (("vmm_bench", vmm), ("alloc_bench", alloc), ("gpu_daemon_check", daemon),
                      ("elastic_overhead_bench", engine), ("demo", demo)):
        doc = _load(d, stem)
        if doc is None:
            continue
        try:
            print(fmt(doc))
        except (KeyError, TypeError, ValueError) as e:
            print(f"{stem}: unreadable result ({type(e).__name__}: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
