"""This tree against an earlier revision, on one benchmark, interleaved and repeated.

A change that should not move a number (a restructuring) is checked by running the same
benchmark on both trees in one run: the base revision is checked out into a temporary git
worktree, and each round runs the benchmark once on each tree (base first on odd rounds,
this tree first on even ones), each with its own copy of the benchmark script and its own
package on ``PYTHONPATH`` (servers and daemons the benchmark starts inherit it). The
benchmark writes its usual JSON; the numbers named below are read back from it.

    python benchmarks/revision_compare.py --base 83b2be8 --rounds 4 alloc
    python benchmarks/revision_compare.py --base 83b2be8 --rounds 2 vllm
    python benchmarks/revision_compare.py --base 84d1da3 --rounds 3 reclaim
    python benchmarks/revision_compare.py --base 84d1da3 --rounds 3 decode

Prints, per number, the medians over rounds on each tree and head / base (of the medians,
and the median of the per-round ratios), and writes
benchmarks/results/revision_compare_<bench>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import write_result  # noqa: E402

#: benchmark -> (script, arguments, {label: path into its JSON})
BENCHES: dict[str, tuple[str, list[str], dict[str, tuple[str, ...]]]] = {
    "alloc": ("benchmarks/alloc_bench.py", [], {
        "fast path alloc(1)+free us/block": ("fast_path_us_per_block", "alloc1_free"),
        "fast path alloc(16)+free us/block": ("fast_path_us_per_block", "alloc16_free"),
        "grant 1 page us/page": ("slow_path", "1", "daemon_us_per_page"),
        "grant 8 pages us/page": ("slow_path", "8", "daemon_us_per_page"),
        "grant 64 pages us/page": ("slow_path", "64", "daemon_us_per_page"),
        "grant 64 pages / floor": ("slow_path", "64", "ratio"),
    }),
    "reclaim": ("benchmarks/reclaim_bench.py", ["--reps", "5"], {
        "lease grant by reclaim us": ("lease_grant", "median_us"),
        "floor (unmap + release) us": ("floor_unmap_release", "median_us"),
        "reclaim / floor": ("ratio_to_floor_median",),
    }),
    "decode": ("benchmarks/elastic_overhead_bench.py",
               ["--reps", "10", "--batches", "1,8,32"], {
        "elastic decode step batch 1 us": ("results", "0", "elastic", "median_us"),
        "elastic decode step batch 8 us": ("results", "1", "elastic", "median_us"),
        "elastic decode step batch 32 us": ("results", "2", "elastic", "median_us"),
        "elastic / static paired step (geomean)": ("overall_paired_ratio_geomean",),
    }),
    "vllm": ("benchmarks/vllm_overhead_bench.py",
             ["--reps", "6", "--requests", "8", "--tokens", "128"], {
        "vLLM elastic decode step s": ("comparison", "engine_step_s", "elastic_median"),
        "vLLM elastic / static decode step": ("ratio_decode_step_elastic_over_static",),
        "vLLM elastic / static paired step": ("paired_median_decode_step_ratio",),
        "vLLM elastic CPU s/token": ("comparison", "cpu_per_token_s", "elastic_median"),
        "vLLM elastic / static throughput": ("ratio_throughput_elastic_over_static",),
    }),
}


def dig(doc: dict, path: tuple[str, ...]) -> float:
    value: object = doc
    for key in path:
        if isinstance(value, list):  # a list's item by its index
            value = value[int(key)]
            continue
        assert isinstance(value, dict), f"{path}: not an object at {key!r}"
        value = value[key]
    assert isinstance(value, (int, float)), f"{path}: not a number"
    return float(value)


def run_once(tree: Path, script: str, args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / script), *args, "--out", str(out)],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", choices=sorted(BENCHES))
    ap.add_argument("--base", required=True, help="the revision to compare against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    script, bench_args, metrics = BENCHES[args.bench]

    with tempfile.TemporaryDirectory(prefix="kvpool-base-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                        str(base_tree), args.base], check=True)
        samples: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
        try:
            for rnd in range(args.rounds):
                order = [("base", base_tree), ("head", REPO)]
                if rnd % 2:
                    order.reverse()
                for side, tree in order:
                    doc = run_once(tree, script, bench_args, Path(tmp) / f"{side}{rnd}.json")
                    for label, path in metrics.items():
                        samples[side].setdefault(label, []).append(dig(doc, path))
                    print(f"round {rnd + 1}/{args.rounds} {side} done", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(base_tree)], check=False)

    rows = {}
    print(f"\n{'number':40} {'base':>12} {'head':>12} {'head/base':>10} {'paired':>8}")
    for label in metrics:
        base, head = samples["base"][label], samples["head"][label]
        b, h = statistics.median(base), statistics.median(head)
        paired = statistics.median(x / y for x, y in zip(head, base))
        rows[label] = {"base": base, "head": head, "base_median": b, "head_median": h,
                       "ratio_of_medians": h / b, "paired_median_ratio": paired}
        print(f"{label:40} {b:12.4g} {h:12.4g} {h / b:10.3f} {paired:8.3f}")
    head_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
    write_result(f"revision_compare_{args.bench}",
                 {"base": args.base, "head": head_rev, "rounds": args.rounds,
                  "bench_args": bench_args, "numbers": rows}, args.out)


if __name__ == "__main__":
    main()
