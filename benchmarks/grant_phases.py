"""An honest tenant's grant latency per phase, as ratios to a baseline phase measured
in the same run (``attack_bench``, ``hol_bench``): the timing loop, the summary and
the printed table and the recorded JSON they share."""

from __future__ import annotations

import argparse
import time

from common import summarize, write_result


def time_grants(group, seconds: float, held: bool = False) -> list[int]:
    """Grant and release unit 0 of ``group`` for ``seconds``; nanoseconds per grant.

    ``held``: the unit is held between samples (released just before each timed grant),
    so a budget that is full stays full; otherwise it is released right after."""
    samples = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if held:
            group.release([0])
        t0 = time.perf_counter_ns()
        group.grant([0])
        samples.append(time.perf_counter_ns() - t0)
        if not held:
            group.release([0])
        time.sleep(0.001)
    return samples


def against_baseline(samples: dict[str, list[int]], baseline: str = "baseline") -> dict:
    """``{phase: summary}``, baseline first: each summary (``common.summarize``) plus
    ``max_us``, and for the other phases ``p50_ratio`` / ``p99_ratio`` to the baseline."""
    base = summarize(samples[baseline])
    base["max_us"] = max(samples[baseline]) / 1e3
    out = {baseline: base}
    for phase, xs in samples.items():
        if phase == baseline:
            continue
        s = summarize(xs)
        s["max_us"] = max(xs) / 1e3
        s["p50_ratio"] = s["median_us"] / base["median_us"]
        s["p99_ratio"] = s["p99_us"] / base["p99_us"]
        out[phase] = s
    return out


def print_phases(results: dict, width: int) -> None:
    """One row per phase: n, p50, p99, max (us) and the two ratios (1.00 for the baseline)."""
    print(f"{'phase':<{width}} {'n':>6} {'p50 us':>9} {'p99 us':>10} {'max us':>10} "
          f"{'p50 x':>7} {'p99 x':>7}")
    for phase, s in results.items():
        print(f"{phase:<{width}} {s['n']:>6} {s['median_us']:>9.0f} {s['p99_us']:>10.0f} "
              f"{s['max_us']:>10.0f} {s.get('p50_ratio', 1.0):>7.2f} "
              f"{s.get('p99_ratio', 1.0):>7.2f}")


def arguments(doc: str, seconds: float) -> argparse.ArgumentParser:
    """The options every phase benchmark takes: ``--reps``, ``--seconds`` (per phase),
    ``--out`` (default ``benchmarks/results/NAME.json``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=seconds, help="per phase")
    ap.add_argument("--out", default=None)
    return ap


def report(name: str, results: dict, args: argparse.Namespace, page_size: int,
           budget_pages: int, width: int) -> None:
    """Print the table and write ``results`` with the run's parameters (``write_result``)."""
    print_phases(results, width)
    path = write_result(name, {
        "page_size": page_size, "budget_pages": budget_pages, "reps": args.reps,
        "seconds_per_phase": args.seconds, "results": results}, args.out)
    print(f"wrote {path}")
