"""The start-up race (issue 36 item 3) measured: kvpool's policy against ``reconcile``
(AIBrix ModelClaim's out-of-path controller, at its defaults: ceilings every 10 s, floor
10%), the same race, repeated, the policies interleaved.

The race (``tests/fleet/startup_race.py``, which defines every number): a ``kvpool fleet
--with-daemon`` on the host backend (64 KiB pages) of two tiny-model engines started
together, each sized for 80% of the KV capacity ``C`` the budget leaves beside their
weights; the first engine's requests (8 at a time, each sent again when answered) come
first and it grows past its entitled ceiling, then the second's too; both stay busy for
``--hold`` seconds; the daemon is sampled (``stats``, ``check``) in a loop throughout.
An engine's **entitled ceiling** is what reconcile's controller gives it when it plans for
the two active engines holding nothing (``reconcile.ceilings``: C/2 each here; kvpool's
fair share is the same); **over-commit** at a sample is the KV held above entitled
ceilings while the other engine, below its own, has requests in flight. Reported per
run: its peak (bytes), its integral (bytes x seconds), the seconds it lasted, each
engine's peak KV, the pool's grants against the budget (never above under either policy:
the daemon refuses what free memory does not cover), ``kvpool check``'s problems, and
reconcile's rounds during the run. A reconcile round does not end the window: its
ceilings are ``max(floor, KV in use)`` plus a part of the rest, so the first engine keeps
what it holds; under kvpool the window is the reclaim that takes the excess back.

    python benchmarks/startup_race_bench.py                 # 3 repetitions, 10 s holds
    python benchmarks/startup_race_bench.py --reps 1 --hold 5

Prints a table and writes benchmarks/results/startup_race.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from common import log, write_result  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from fleet.startup_race import (  # noqa: E402
    CAPACITY_UNITS, FLOOR_PERCENT, KV_UNITS, MAX_TOKENS, PAGE, PROMPT_TOKENS, SEQS,
    make_models, run_race)

KIB = 1024
#: each policy as the race runs it: its [fleet] knob lines (reconcile: its defaults)
POLICIES = {"kvpool": "", "reconcile": f"floor_percent = {FLOOR_PERCENT:g}\n"}
console = Console(width=160)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each policy")
    ap.add_argument("--hold", type=float, default=10.0,
                    help="seconds both engines stay busy once the second's requests begin")
    ap.add_argument("--out", help="the JSON file (default benchmarks/results/startup_race.json)")
    args = ap.parse_args()
    if args.reps < 1 or not 0 < args.hold <= 600:
        raise SystemExit("startup_race_bench: --reps must be at least 1 and --hold in 0-600 s")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-race-") as tmp:
        models = make_models(Path(tmp) / "models")
        for rep in range(args.reps):
            for policy, knobs in POLICIES.items():
                log(f"rep {rep + 1}/{args.reps}: {policy}")
                race = run_race(Path(tmp) / f"{policy}-{rep}", models, policy, knobs,
                                hold_s=args.hold, say=log)
                runs.append({"rep": rep + 1, **race.summary()})
    table = Table(title="Start-up race: two engines, each sized for 80% of the KV capacity "
                        "(over-commit: KV held above the entitled ceiling, C/2, while the "
                        "other engine waits below its own)")
    for col in ("policy", "rep", "peak over KiB", "over KiB x s", "window s",
                "peak KV alpha/beta KiB", "C KiB", "rounds", "grants over budget",
                "check problems"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        table.add_row(r["policy"], str(r["rep"]), f"{r['peak_over_bytes'] / KIB:g}",
                      f"{r['over_byte_seconds'] / KIB:.1f}", f"{r['over_window_s']:.2f}",
                      "/".join(f"{r['peak_held'][n] // KIB}" for n in ("alpha", "beta")),
                      f"{r['capacity'] // KIB}", str(r["reconcile_rounds"]),
                      str(max(0, r["max_granted_over_budget"])),
                      str(len(r["check_problems"])))
    console.print(table)
    summary = {}
    for policy in POLICIES:
        mine = [r for r in runs if r["policy"] == policy]
        summary[policy] = {
            "peak_over_bytes_max": max(r["peak_over_bytes"] for r in mine),
            "over_byte_seconds_median": statistics.median(r["over_byte_seconds"] for r in mine),
            "over_byte_seconds_max": max(r["over_byte_seconds"] for r in mine),
            "over_window_s_median": statistics.median(r["over_window_s"] for r in mine),
            "grants_over_budget": max(0, max(r["max_granted_over_budget"] for r in mine)),
            "check_problems": sorted({x for r in mine for x in r["check_problems"]}),
        }
        s = summary[policy]
        console.print(f"{policy}: peak over-commit {s['peak_over_bytes_max'] / KIB:g} KiB, "
                      f"{s['over_byte_seconds_median'] / KIB:.1f} KiB x s (median; max "
                      f"{s['over_byte_seconds_max'] / KIB:.1f}), window "
                      f"{s['over_window_s_median']:.2f} s (median)")
    path = write_result("startup_race", {
        "params": {"page_size": PAGE, "kv_capacity_units": CAPACITY_UNITS,
                   "kv_cache_size_units": KV_UNITS, "max_num_seqs": SEQS,
                   "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                   "hold_s": args.hold, "reps": args.reps, "policies": POLICIES,
                   "backend": "host"},
        "definitions": {
            "entitled": "reconcile.ceilings(C, floor_percent, two active engines holding "
                        "nothing): C/2 each; kvpool's equal fair share is the same",
            "over": "sum over engines of max(0, KV held - entitled), at samples where the "
                    "other engine has requests in flight and holds less than its own",
            "over_byte_seconds": "over integrated over the samples (left rectangles)",
        },
        "summary": summary,
        "runs": runs,
    }, args.out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
