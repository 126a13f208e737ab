"""Summaries, tables and the memory-over-time chart of demo and benchmark runs."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from kvpool.demo.driver import Replay


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(replay: Replay, preemptions: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per model and ``all``: TTFT mean/p50/p99, TPOT mean, finished, errors, memory."""
    models = sorted({o.model for o in replay.outcomes})
    out: dict[str, dict[str, Any]] = {}
    for model in models + ["all"]:
        mine = [o for o in replay.outcomes if model in ("all", o.model)]
        ok = [o for o in mine if o.error is None]
        ttft = [o.ttft for o in ok if o.ttft is not None]
        tpot = [o.tpot for o in ok if o.tpot is not None]
        if model == "all":
            mem = [sum(v for k, v in row.items() if k != "t") for row in replay.memory]
        else:
            mem = [row.get(model, 0) for row in replay.memory]
        out[model] = {
            "requests": len(mine),
            "finished": len(ok),
            "errors": len(mine) - len(ok),
            "ttft_mean": statistics.fmean(ttft) if ttft else None,
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "tpot_mean": statistics.fmean(tpot) if tpot else None,
            "output_tokens": sum(o.output_tokens for o in ok),
            "preemptions": (
                sum((preemptions or {}).values())
                if model == "all"
                else (preemptions or {}).get(model, 0)
            ),
            "mem_peak": max(mem) if mem else 0,
            "mem_mean": statistics.fmean(mem) if mem else 0,
        }
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def table(title: str, runs: dict[str, dict[str, dict[str, Any]]]) -> Table:
    """One row per (mode, model): runs = {mode: summarize(...)}."""
    from kvpool.sizes import format_size

    t = Table(title=title)
    for col in ("mode", "model", "done", "TTFT mean", "TTFT p50", "TTFT p99", "TPOT",
                "preempted", "mem peak", "mem mean"):
        t.add_column(col, justify="left" if col in ("mode", "model") else "right")
    for mode, summary in runs.items():
        for model, s in summary.items():
            t.add_row(
                mode, model, f"{s['finished']}/{s['requests']}", _ms(s["ttft_mean"]),
                _ms(s["ttft_p50"]), _ms(s["ttft_p99"]), _ms(s["tpot_mean"]),
                str(s["preemptions"]), format_size(s["mem_peak"]), format_size(s["mem_mean"]),
            )
        t.add_section()
    return t


def chart(path: Path, replays: dict[str, Replay], budget: int, title: str) -> Path:
    """Memory over time per model, one panel per mode, budget drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(replays), 1, figsize=(9, 3.2 * len(replays)), sharex=True,
                             squeeze=False)
    for ax, (mode, rep) in zip(axes[:, 0], replays.items()):
        models = sorted({k for row in rep.memory for k in row if k != "t"})
        ts = [row["t"] for row in rep.memory]
        ys = [[row.get(m, 0) / 2**20 for row in rep.memory] for m in models]
        if ts:
            ax.stackplot(ts, ys, labels=models, alpha=0.8)
        ax.axhline(budget / 2**20, color="black", linestyle="--", linewidth=1, label="budget")
        ax.set_ylabel("KV memory (MiB)")
        ax.set_title(f"{mode}")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
