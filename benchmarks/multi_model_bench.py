"""Static partitions vs elastic sharing for several models on one device, swept over
the burst peak rate: where elastic sharing wins, and that it costs nothing without
contention. Same processes, workload and engine code as ``kvpool demo``.

    python benchmarks/multi_model_bench.py --peaks 1,4,8,12 --duration 40
    python benchmarks/multi_model_bench.py --engine vllm --peaks 8 --duration 40

Writes benchmarks/results/multi_model_bench.json and multi_model_bench.png (p99 / mean
TTFT against the peak rate, and memory over time at the demo's peak).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_result  # noqa: E402

from kvpool.demo import report  # noqa: E402
from kvpool.demo.run import DemoConfig, check_outcomes, ensure_models, run_mode  # noqa: E402
from kvpool.sizes import format_size, parse_size  # noqa: E402


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


@click.command()
@click.option("--peaks", default="1,4,8,12", show_default=True,
              help="peak rates (req/s of the bursting model) to sweep")
@click.option("--base-rate", default=0.3, show_default=True)
@click.option("--duration", default=40.0, show_default=True, help="seconds per run")
@click.option("--budget", default="48MiB", show_default=True)
@click.option("--page-size", default="2MiB", show_default=True)
@click.option("--engine", type=click.Choice(["bundled", "vllm"]), default="bundled",
              show_default=True, help="kvpool's bundled engine or vLLM servers")
@click.option("--models", default="alpha,beta,gamma", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--chart-peak", default=8.0, show_default=True,
              help="the sweep point whose memory-over-time chart is kept")
@click.option("--out-dir", default="/tmp/kvpool-multi-model-bench", show_default=True,
              help="models and logs")
def main(peaks: str, base_rate: float, duration: float, budget: str, page_size: str,
         engine: str, models: str, seed: int, chart_peak: float, out_dir: str) -> None:
    console = Console(width=None if sys.stdout.isatty() else 150)
    names = tuple(models.split(","))
    cfg = DemoConfig(out_dir=Path(out_dir), models=names, budget=parse_size(budget),
                     page_size=parse_size(page_size), live=False, engine=engine)
    w = cfg.workload
    w.models, w.duration_s, w.phase_s = list(names), duration, duration / (2 * len(names))
    w.base_rate, w.seed = base_rate, seed
    ensure_models(cfg)
    rows, kept = [], {}
    for peak in [float(x) for x in peaks.split(",")]:
        w.peak_rate = peak
        point = {"peak_rate": peak}
        for mode in ("static", "elastic"):
            rep, final = run_mode(cfg, mode, console)
            check_outcomes(mode, rep)
            pre = {m: s.get("preemptions", 0) for m, s in final.items()}
            point[mode] = report.summarize(rep, pre)["all"]
            point[mode]["idle_pages"] = {m: s.get("idle_bytes", 0) / cfg.page_size
                                         for m, s in final.items()}
            if peak == chart_peak:
                kept[mode] = rep
        s, e = point["static"], point["elastic"]
        point["p99_ratio_static_over_elastic"] = _ratio(s["ttft_p99"], e["ttft_p99"])
        point["mean_ratio_static_over_elastic"] = _ratio(s["ttft_mean"], e["ttft_mean"])
        rows.append(point)
        console.print(f"peak {peak:g} req/s: p99 TTFT static {_ms(s['ttft_p99'])} ms, "
                      f"elastic {_ms(e['ttft_p99'])} ms")

    table = Table(title=f"{len(names)} models, KV budget {format_size(cfg.budget)}, "
                        f"base {base_rate:g} req/s, {duration:.0f} s per run (TTFT in ms)")
    for col in ("peak req/s", "requests", "static p50", "static p99", "static mean",
                "elastic p50", "elastic p99", "elastic mean", "p99 static/elastic",
                "mean static/elastic", "preempt s/e"):
        table.add_column(col, justify="right")
    for r in rows:
        s, e = r["static"], r["elastic"]
        table.add_row(f"{r['peak_rate']:g}", str(s["requests"]), _ms(s["ttft_p50"]),
                      _ms(s["ttft_p99"]), _ms(s["ttft_mean"]), _ms(e["ttft_p50"]),
                      _ms(e["ttft_p99"]), _ms(e["ttft_mean"]),
                      f"{r['p99_ratio_static_over_elastic'] or 0:.2f}",
                      f"{r['mean_ratio_static_over_elastic'] or 0:.2f}",
                      f"{s['preemptions']}/{e['preemptions']}")
    console.print(table)
    name = "multi_model_bench" if engine == "bundled" else f"multi_model_bench_{engine}"
    chart = _chart(rows, RESULTS / f"{name}.png")
    if kept:
        report.chart(RESULTS / f"{name}_memory.png", kept, cfg.budget,
                     f"KV memory per model, peak {chart_peak:g} req/s")
    path = write_result(name, {
        "engine": engine, "models": list(names), "budget": cfg.budget,
        "page_size": cfg.page_size,
        "base_rate": base_rate, "duration_s": duration, "seed": seed,
        "workload": {"prompt_range": w.prompt_range, "output_range": w.output_range,
                     "trace": w.trace, "prompt_scale": w.prompt_scale,
                     "output_scale": w.output_scale},
        "sweep": rows, "chart": str(chart.name)})
    console.print(f"wrote {path} and {chart}")


def _chart(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["peak_rate"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (key, title) in enumerate((("ttft_p99", "p99 TTFT"), ("ttft_mean", "mean TTFT"))):
        for mode in ("static", "elastic"):
            ax[i].plot(xs, [(r[mode][key] or 0) * 1e3 for r in rows], marker="o", label=mode)
        ax[i].set_xlabel("peak rate of the bursting model (req/s)")
        ax[i].set_ylabel("ms")
        ax[i].set_title(title)
        ax[i].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
