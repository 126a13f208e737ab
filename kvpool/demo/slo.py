"""The fleet demo's service-level objective, and each mode's outcome against it.

A request *meets the SLO* when it finished, its first token came within ``ttft_s`` of
sending it (queueing, a wake and the prefill included: what the user waits) and its
tokens then came at ``tpot_s`` each or faster (mean over the answer). A request that
failed (no server for its model, an error) misses it. *Attainment* is the share of all
requests of the run that met it: a mode that serves only the models that fit loses the
others' requests.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from rich.table import Table

from kvpool.demo.driver import Outcome, Replay
from kvpool.demo.report import percentile
from kvpool.demo.wakes import WakeStats


@dataclass(frozen=True)
class Slo:
    """Per request: time to first token at most ``ttft_s``, time per output token (mean
    over the answer) at most ``tpot_s``."""

    ttft_s: float
    tpot_s: float

    def met(self, o: Outcome) -> bool:
        return (o.error is None and o.ttft is not None and o.ttft <= self.ttft_s
                and (o.tpot is None or o.tpot <= self.tpot_s))


def _block(outcomes: Sequence[Outcome], slo: Slo) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    tpot = [o.tpot for o in ok if o.tpot is not None]
    met = sum(1 for o in outcomes if slo.met(o))
    return {
        "requests": len(outcomes), "served": len(ok), "failed": len(outcomes) - len(ok),
        "slo_met": met, "slo_attainment": met / len(outcomes) if outcomes else 0.0,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_mean": statistics.fmean(tpot) if tpot else None,
        "output_tokens": sum(o.output_tokens for o in ok),
    }


def summarize(rep: Replay, slo: Slo, models: Sequence[str], wakes: WakeStats,
              resident: Sequence[str], budget: int | None = None,
              duration_s: float | None = None) -> dict[str, Any]:
    """One mode: ``all`` (every request), each model's block, which models had a server
    (``resident``), how many models got at least one request served, the wakes, and the
    memory peak (weights + KV of every model, bytes; from the samples). With the
    workload's ``duration_s``: goodput (requests and output tokens per second of the
    requests that met the SLO); with the ``budget``: over-commit, the memory held above
    it integrated over the samples (byte-seconds)."""
    out: dict[str, Any] = {"all": _block(rep.outcomes, slo)}
    for m in models:
        out[m] = _block([o for o in rep.outcomes if o.model == m], slo)
    out["all"]["models_served"] = sum(1 for m in models if out[m]["served"])
    out["all"]["models"] = len(models)
    out["all"]["resident"] = list(resident)
    out["all"]["wakes"] = wakes.to_json()
    totals = [sum(row.get("kv", {}).values()) + sum(row.get("weights", {}).values())
              for row in rep.memory]
    out["all"]["mem_peak"] = max(totals, default=0)
    if duration_s:
        met = [o for o in rep.outcomes if slo.met(o)]
        out["all"]["goodput_req_s"] = len(met) / duration_s
        out["all"]["goodput_tok_s"] = sum(o.output_tokens for o in met) / duration_s
    if budget is not None:
        ts = [row.get("t", 0.0) for row in rep.memory]
        out["all"]["over_commit_byte_s"] = sum(
            max(0, total - budget) * (ts[i + 1] - ts[i])
            for i, total in enumerate(totals[:-1]))
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def table(title: str, runs: dict[str, dict[str, Any]]) -> Table:
    """One row per mode (``runs`` = {mode: summarize(...)}); goodput is requests per
    second that met the SLO, cold starts the member starts of a fleet during the run."""
    from kvpool.sizes import format_size

    t = Table(title=title)
    for col in ("mode", "models served", "served", "failed", "SLO met", "goodput",
                "TTFT p50", "TTFT p99", "TPOT", "wakes", "wake p50", "wake max",
                "cold starts", "mem peak"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode, s in runs.items():
        a, w = s["all"], s["all"]["wakes"]
        t.add_row(mode, f"{a['models_served']}/{a['models']}",
                  f"{a['served']}/{a['requests']}", str(a["failed"]),
                  f"{a['slo_attainment']:.0%}",
                  "-" if a.get("goodput_req_s") is None else f"{a['goodput_req_s']:.2f}/s",
                  _ms(a["ttft_p50"]), _ms(a["ttft_p99"]),
                  _ms(a["tpot_mean"]), str(w["count"]), _ms(w["p50_s"]), _ms(w["max_s"]),
                  str(w.get("cold_starts", "-")), format_size(a["mem_peak"]))
    return t
