"""The fleet demo's chart: memory per model over time, weights and KV stacked, one panel
per mode, the budget drawn as a line.

Each memory sample is ``{"t": seconds, "weights": {model: bytes}, "kv": {model: bytes}}``
(the driver adds ``t``). Each model has one colour: its weights solid, its KV the same
colour lighter and hatched, stacked model after model, so the panel's top edge is
everything the models hold and a model that went to sleep drops out of the stack. An
optional ``"cached"`` (bytes) is the weight sets nobody holds that the daemon keeps
while memory allows (a warm wake re-attaches them), stacked on top in grey.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

MIB = 2**20
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def chart(path: Path, panels: dict[str, list[dict[str, Any]]], models: Sequence[str],
          budget: int, title: str) -> Path:
    """Write the PNG (``panels``: {mode: memory samples}) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = COLOURS
    any_cached = False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.8 * len(panels) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (mode, rows) in zip(axes[:, 0], panels.items()):
        ts = [row["t"] for row in rows]
        series: list[list[float]] = []
        cols: list[str] = []
        hatches: list[str] = []
        for i, m in enumerate(models):
            c = colours[i % len(colours)]
            series.append([row.get("weights", {}).get(m, 0) / MIB for row in rows])
            series.append([row.get("kv", {}).get(m, 0) / MIB for row in rows])
            cols += [c, c]
            hatches += ["", "///"]
        series.append([row.get("cached", 0) / MIB for row in rows])
        cols.append("lightgrey")
        hatches.append("..")
        any_cached = any_cached or any(row.get("cached", 0) for row in rows)
        if ts:
            stacks = ax.stackplot(ts, series, colors=cols, linewidth=0)
            for poly, hatch in zip(stacks, hatches):
                if hatch:
                    poly.set_alpha(0.45)
                    poly.set_hatch(hatch)
        ax.axhline(budget / MIB, color="black", linestyle="--", linewidth=1)
        ax.set_ylabel("MiB")
        ax.set_title(mode, fontsize=10)
    handles = [Patch(color=colours[i % len(colours)], label=m) for i, m in enumerate(models)]
    handles += [Patch(facecolor="grey", label="weights (solid)"),
                Patch(facecolor="grey", alpha=0.45, hatch="///", label="KV (hatched)"),
                Patch(facecolor="white", edgecolor="black", linestyle="--", label="budget")]
    if any_cached:
        handles.append(Patch(facecolor="lightgrey", hatch="..", label="cached weights"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 0.0))
    axes[-1, 0].set_xlabel("seconds into the workload")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
