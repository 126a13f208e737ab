"""Wakes of sleeping servers during a demo run and how long they took, and a fleet's
member starts and unloads meanwhile (a swap fleet's cold starts).

Three sources, each read before the workload and again after it (the difference is the
run's): every elastic bundled server logs each wake as ``kvpool: awake (REASON) in X s``
(``X``: its restore, the weights re-attached or reloaded and the null block's KV mapped;
:mod:`kvpool.engine_adapters.sleep_controller`); a fleet's ``/metrics`` has
``kvpool_fleet_wakes_total``, the ``kvpool_fleet_wake_seconds`` histogram (what the
router saw: a request's wait from its arrival until the member was ready) and
``kvpool_fleet_sleeps_total``; and the fleet's own log has one ``fleet: starting T``
line per member start and one ``fleet: unloading T:`` line per unload
(:func:`fleet_log_counts`).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpool.demo.report import percentile

WAKE_LINE = re.compile(r"kvpool: awake \((\w+)\) in ([0-9.]+) s")


def scan_logs(log_dir: Path) -> dict[str, list[float]]:
    """Per file under ``log_dir`` (recursively: servers' logs, whatever their names), the
    seconds of each wake it logged."""
    out: dict[str, list[float]] = {}
    if not log_dir.is_dir():
        return out
    for f in sorted(log_dir.rglob("*")):
        if not f.is_file():
            continue
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        out[str(f)] = [float(m.group(2)) for m in WAKE_LINE.finditer(text)]
    return out


def new_wakes(before: dict[str, list[float]], after: dict[str, list[float]]) -> list[float]:
    """The wakes logged between two :func:`scan_logs` (logs only grow)."""
    return [s for f, secs in after.items() for s in secs[len(before.get(f, [])):]]


def fleet_metrics(url: str) -> dict[str, float]:
    """The fleet's wake and sleep counters (summed over models and causes): ``wakes``,
    ``wake_seconds_sum``, ``wake_seconds_count``, ``sleeps``; empty when ``url`` has no
    such metrics."""
    names = {"kvpool_fleet_wakes_total": "wakes",
             "kvpool_fleet_wake_seconds_sum": "wake_seconds_sum",
             "kvpool_fleet_wake_seconds_count": "wake_seconds_count",
             "kvpool_fleet_sleeps_total": "sleeps"}
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[names[name]] = out.get(names[name], 0.0) + value
    return out


def fleet_log_counts(log: Path | None) -> dict[str, int]:
    """``starts`` and ``unloads`` of members in a ``kvpool fleet`` log so far (empty
    without one)."""
    if log is None or not log.is_file():
        return {}
    text = log.read_text(errors="replace")
    return {"starts": len(START_LINE.findall(text)), "unloads": len(UNLOAD_LINE.findall(text))}


START_LINE = re.compile(r"^fleet: starting \S+ ", re.M)
UNLOAD_LINE = re.compile(r"^fleet: unloading \S+:", re.M)


@dataclass
class WakeStats:
    """A run's wakes: each server's restore time (from the logs) and, through a fleet,
    the router's count and mean wait, its sleeps, and its member starts and unloads."""

    seconds: list[float]
    fleet: dict[str, float]
    starts: int | None = None  # None: not a fleet
    unloads: int | None = None

    @classmethod
    def between(cls, logs_before: dict[str, list[float]], logs_after: dict[str, list[float]],
                fleet_before: dict[str, float], fleet_after: dict[str, float],
                counts_before: dict[str, int] | None = None,
                counts_after: dict[str, int] | None = None) -> WakeStats:
        fleet = {k: v - fleet_before.get(k, 0.0) for k, v in fleet_after.items()}
        before, after = counts_before or {}, counts_after or {}
        diff = {k: after[k] - before.get(k, 0) for k in after}
        return cls(new_wakes(logs_before, logs_after), fleet, diff.get("starts"),
                   diff.get("unloads"))

    def to_json(self) -> dict[str, Any]:
        s = self.seconds
        out: dict[str, Any] = {"count": len(s), "p50_s": percentile(s, 50),
                               "max_s": max(s) if s else None,
                               "mean_s": statistics.fmean(s) if s else None}
        if self.fleet:
            n = self.fleet.get("wake_seconds_count", 0.0)
            out["fleet_wakes"] = int(self.fleet.get("wakes", 0.0))
            out["fleet_wake_wait_mean_s"] = (self.fleet.get("wake_seconds_sum", 0.0) / n
                                             if n else None)
            out["fleet_sleeps"] = int(self.fleet.get("sleeps", 0.0))
        if self.starts is not None:
            out["cold_starts"] = self.starts
            out["unloads"] = self.unloads or 0
        return out
