"""Demo v2, the main job (``kvpool demo``): six models on a device that holds two.

Six tiny generated Llamas (tens of MiB of fp32 weights each) share one memory budget
that holds the weights and working KV of only two of them at once. A seeded bursty
workload rotates across all six (each model takes its turn peaking; the others get a
trickle), prompt and answer lengths from the Azure 2023 traces (:mod:`workload`). Three
modes serve the same workload, one after the other:

* ``static`` — the models that fit (weights + ``working_kv`` each) stay resident, each
  server with a static KV partition of what the budget leaves after their weights;
  requests for the other models fail (no server): what one does today on one device;
* ``elastic`` — the same resident models, weights in the process, their KV elastic
  through a kvpool daemon whose budget is what their weights leave;
* ``fleet`` — all six through one ``kvpool fleet`` endpoint (:mod:`fleet_launch`), the
  daemon owning the whole budget, weights in the pool, idle models asleep and woken by
  their next request.

Each request is judged against one SLO (:mod:`kvpool.demo.slo`); each mode reports requests served
and failed, SLO attainment, TTFT p50/p99 (wakes included: the client's clock), wakes and
wake latency (:mod:`kvpool.demo.wakes`), and memory per model over time, weights and KV stacked
(:mod:`memory_chart`, from the daemon's ``ps`` or the static servers' ``/v1/stats``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
from rich.console import Console

from kvpool.client_lib import Monitor
from kvpool.demo import fleet_launch, memory_chart
from kvpool.demo import slo as slo_report
from kvpool.demo.cluster import Cluster, ClusterError
from kvpool.demo.driver import Replay, replay, warm_up_all
from kvpool.demo.progress import Progress
from kvpool.demo.slo import Slo
from kvpool.demo.wakes import WakeStats, fleet_metrics, scan_logs
from kvpool.demo.workload import WorkloadShape, generate
from kvpool.sizes import format_size

MODES = ("static", "elastic", "fleet")
NAMES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")


def _shape() -> WorkloadShape:
    # Azure conversation trace: context / 8 and generated / 4 (as the kv demo), clipped
    # to 16-256 prompt and 16-96 answer tokens: what six tiny models on 2 cores serve
    # inside the SLO one at a time.
    return WorkloadShape(models=list(NAMES), duration_s=30.0, phase_s=5.0, base_rate=0.1,
                         peak_rate=3.0, prompt_scale=8.0, output_scale=4.0,
                         prompt_range=(16, 256), output_range=(16, 96))


@dataclass
class FleetDemoConfig:
    """Everything a demo v2 run needs; the defaults take about 3 minutes on 2 cores."""

    out_dir: Path = Path("demo-out")
    models: tuple[str, ...] = NAMES
    # a tiny Llama of ~30 MiB fp32 (3 layers, hidden 512, MLP 1024, 8 heads, 4 KV heads):
    # weights matter next to the KV (6 KiB per token)
    layers: int = 3
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 512
    budget: int = 112 << 20  # weights and KV of every model together
    page_size: int = 2 << 20
    working_kv: int = 16 << 20  # KV a resident model needs: the budget fits N x (W + this)
    block_size: int = 16
    max_num_seqs: int = 16
    idle_timeout_s: float = 1.0  # elastic engines give an idle reserve back after this
    sleep_after_s: float = 2.0  # fleet members sleep after this long idle
    # TTFT within 1 s (a wake, a prefill and a short queue; one request alone starts in
    # tens of ms) and 100 ms per token (10 tokens/s, faster than reading; one request
    # alone decodes at a few ms per token): see README, "What the demo shows"
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=1.0, tpot_s=0.1))
    workload: WorkloadShape = field(default_factory=_shape)
    modes: tuple[str, ...] = MODES
    live: bool = True
    start_timeout_s: float = 180.0

    def model_dir(self, name: str) -> Path:
        return self.out_dir / "fleet-models" / name

    def weight_bytes(self, name: str) -> int:
        """The checkpoint's tensor bytes (what ``--weights local`` keeps in the process)."""
        return sum(f.stat().st_size for f in self.model_dir(name).glob("*.safetensors"))

    def resident(self) -> tuple[str, ...]:
        """The models that fit (weights rounded up to pages, plus ``working_kv`` each),
        at least one: the ``static`` and ``elastic`` modes serve only these."""
        page = self.page_size
        need = max(-(-self.weight_bytes(m) // page) * page for m in self.models)
        n = max(1, min(len(self.models), self.budget // (need + self.working_kv)))
        return self.models[:n]


def ensure_models(cfg: FleetDemoConfig) -> None:
    """Write the six checkpoints once (kept between runs), each with its own seed."""
    from kvpool.engine.model.tiny import make_tiny_model

    for i, name in enumerate(cfg.models):
        d = cfg.model_dir(name)
        if not (d / "config.json").exists():
            make_tiny_model(d, layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                            kv_heads=cfg.kv_heads, vocab=cfg.vocab, seed=100 + i)


def _engine_args(cfg: FleetDemoConfig) -> tuple[str, ...]:
    return ("--device", "cpu", "--max-num-seqs", str(cfg.max_num_seqs), "--block-size",
            str(cfg.block_size))


@dataclass
class ModeRun:
    """What one mode got: the replay (outcomes, memory samples), its wakes, which models
    had a server and how the fleet was started (fleet mode)."""

    replay: Replay
    wakes: WakeStats
    resident: tuple[str, ...]
    via: str = ""


def _static_sampler(urls: dict[str, str], weights: dict[str, int]
                    ) -> Callable[[], dict[str, Any]]:
    def sample() -> dict[str, Any]:
        kv: dict[str, int] = {}
        for m, url in urls.items():
            try:
                kv[m] = int(httpx.get(f"{url}/v1/stats", timeout=5).json()["kv_held_bytes"])
            except (httpx.HTTPError, KeyError, ValueError, TypeError):
                kv[m] = 0
        return {"kv": kv, "weights": dict(weights)}
    return sample


def _daemon_sampler(monitor: Monitor, models: tuple[str, ...],
                    local_weights: dict[str, int] | None) -> Callable[[], dict[str, Any]]:
    """One ``ps`` per sample (a consistent snapshot): KV (``mapped``) per tenant, weights
    from the pool (``weights``) or, for local weights, the checkpoint sizes."""
    def sample() -> dict[str, Any]:
        reply = monitor.ps()
        mine = {t.name: t for t in reply.tenants if t.name in models}
        row: dict[str, Any] = {
            "kv": {m: t.mapped for m, t in mine.items()},
            "weights": (dict(local_weights) if local_weights is not None
                        else {m: t.weights for m, t in mine.items()}),
            "state": {m: t.state for m, t in mine.items()},
        }
        if reply.pool is not None:
            row["cached"] = reply.pool.weights_cached
        return row
    return sample


def _warm(urls: dict[str, str]) -> None:
    """One warm-up request per server before the workload, as the fleet's members get
    (:mod:`kvpool.demo.fleet_launch`): a server's first request pays first-use costs."""
    try:
        warm_up_all(urls)
    except httpx.HTTPError as e:
        raise ClusterError(f"a warm-up request failed: {e}") from None


def run_mode(cfg: FleetDemoConfig, mode: str, console: Console) -> ModeRun:
    """Start the processes of ``mode``, replay the workload, stop everything."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    arrivals = generate(cfg.workload)
    resident = cfg.models if mode == "fleet" else cfg.resident()
    weights = {m: cfg.weight_bytes(m) for m in resident}
    env = {"KVPOOL_IDLE_TIMEOUT": str(cfg.idle_timeout_s)}
    kv_budget = cfg.budget - sum(-(-w // cfg.page_size) * cfg.page_size
                                 for w in weights.values())
    via = ""
    with Cluster(cfg.out_dir / "logs" / f"fleet-{mode}") as cluster:
        monitor: Monitor | None = None
        metrics_url: str | None = None
        log_dir = cluster.workdir
        if mode == "static":
            part = kv_budget // len(resident) // cfg.page_size * cfg.page_size
            procs = {m: cluster.serve(m, cfg.model_dir(m), part, False,
                                      extra=_engine_args(cfg)) for m in resident}
            cluster.wait_healthy(cfg.start_timeout_s)
            urls = {m: p.url for m, p in procs.items() if p.url is not None}
            _warm(urls)
            sample = _static_sampler(urls, weights)
        elif mode == "elastic":
            cluster.daemon(kv_budget, cfg.page_size)
            procs = {m: cluster.serve(m, cfg.model_dir(m), kv_budget, True,
                                      extra=_engine_args(cfg), env=env) for m in resident}
            cluster.wait_healthy(cfg.start_timeout_s)
            urls = {m: p.url for m, p in procs.items() if p.url is not None}
            _warm(urls)
            assert cluster.run_dir is not None  # the daemon's
            monitor = Monitor(cluster.run_dir)
            sample = _daemon_sampler(monitor, resident, weights)
        else:
            cluster.daemon(cfg.budget, cfg.page_size)
            members = [fleet_launch.Member(m, cfg.model_dir(m).resolve(), cfg.budget,
                                           cfg.budget, cfg.sleep_after_s, cfg.max_num_seqs,
                                           cfg.block_size) for m in cfg.models]
            launched = fleet_launch.launch(cluster, members, cfg.out_dir / "FLEET.toml",
                                           cfg.budget, cfg.page_size, env,
                                           wave=len(cfg.resident()),
                                           timeout_s=cfg.start_timeout_s)
            urls, via, log_dir = launched.urls, launched.via, launched.log_dir
            metrics_url = launched.metrics_url
            assert cluster.run_dir is not None
            monitor = Monitor(cluster.run_dir)
            sample = _daemon_sampler(monitor, cfg.models, None)
        console.print(f"{mode}: serving {', '.join(urls)}"
                      + (f" ({via})" if via else "")
                      + ("" if len(urls) == len(cfg.models) else
                         f"; requests for {', '.join(m for m in cfg.models if m not in urls)}"
                         f" fail (they do not fit)"))

        progress = Progress(mode, arrivals, cfg.models, memory_label="memory")

        def sample_and_show() -> dict[str, Any]:
            row = sample()
            progress.memory = {m: row["kv"].get(m, 0) + row["weights"].get(m, 0)
                               for m in cfg.models}
            progress.show()
            return row

        logs_before = scan_logs(log_dir)
        fleet_before = fleet_metrics(metrics_url) if metrics_url else {}
        with progress.watch(console, cfg.live):
            rep = replay(arrivals, urls, cfg.vocab, sample_memory=sample_and_show,
                         on_done=progress.done)
        fleet_after = fleet_metrics(metrics_url) if metrics_url else {}
        woke = WakeStats.between(logs_before, scan_logs(log_dir), fleet_before,
                                       fleet_after)
        if monitor is not None:
            problems = monitor.check()
            monitor.close()
            if problems:
                raise ClusterError(f"the daemon's invariant check failed: {problems}")
        cluster.check_alive()  # a process that died mid-run fails the run
    return ModeRun(rep, woke, tuple(urls), via)


def run_fleet_demo(cfg: FleetDemoConfig, console: Console | None = None) -> dict[str, Any]:
    """Every mode, the table, the chart and the JSON. Raises on a failed process (a
    request that fails is counted, not raised)."""
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    t_all = time.perf_counter()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    ensure_models(cfg)
    arrivals = generate(cfg.workload)
    w = cfg.workload
    weight = cfg.weight_bytes(cfg.models[0])
    resident = cfg.resident()
    if cfg.budget < -(-weight // cfg.page_size) * cfg.page_size + cfg.working_kv:
        raise ClusterError(f"budget {format_size(cfg.budget)} cannot hold one model's "
                           f"weights ({format_size(weight)}) and "
                           f"{format_size(cfg.working_kv)} of KV")
    console.print(
        f"[bold]kvpool demo[/] (fleet): {len(cfg.models)} models of "
        f"{format_size(weight)} weights each, budget {format_size(cfg.budget)} "
        f"({format_size(cfg.page_size)} pages): weights + {format_size(cfg.working_kv)} of "
        f"KV fit for {len(resident)} ({', '.join(resident)}); {len(arrivals)} requests over "
        f"{w.duration_s:g} s, each model in turn peaking at {w.peak_rate:g} req/s (others "
        f"{w.base_rate:g}); SLO: TTFT <= {cfg.slo.ttft_s * 1e3:.0f} ms and TPOT <= "
        f"{cfg.slo.tpot_s * 1e3:.0f} ms")
    runs: dict[str, ModeRun] = {}
    summaries: dict[str, dict[str, Any]] = {}
    timings: dict[str, float] = {}
    for mode in cfg.modes:
        t0 = time.perf_counter()
        run = run_mode(cfg, mode, console)
        timings[mode] = time.perf_counter() - t0
        runs[mode] = run
        summaries[mode] = slo_report.summarize(run.replay, cfg.slo, cfg.models, run.wakes,
                                        run.resident)
        if run.via:
            summaries[mode]["all"]["via"] = run.via
        a = summaries[mode]["all"]
        console.print(f"{mode}: {a['served']}/{a['requests']} served, SLO met "
                      f"{a['slo_attainment']:.0%}, in {timings[mode]:.0f} s")
    console.print(slo_report.table(f"{len(cfg.models)} models, budget {format_size(cfg.budget)}: "
                            f"SLO TTFT <= {cfg.slo.ttft_s * 1e3:.0f} ms, TPOT <= "
                            f"{cfg.slo.tpot_s * 1e3:.0f} ms (times in ms)", summaries))
    result: dict[str, Any] = {"config": _config_json(cfg), "summary": summaries,
                              "timings_s": timings}
    if "fleet" in summaries:
        best = max((summaries[m]["all"]["slo_attainment"] for m in summaries if m != "fleet"),
                   default=None)
        fleet = summaries["fleet"]["all"]
        if best is not None:
            ratio = fleet["slo_attainment"] / best if best else float("inf")
            result["slo_ratio_fleet_over_best_baseline"] = ratio
            console.print(f"SLO attainment: fleet {fleet['slo_attainment']:.0%} vs best "
                          f"baseline {best:.0%} ({ratio:.1f}x); fleet served "
                          f"{fleet['models_served']}/{fleet['models']} models")
    chart = memory_chart.chart(cfg.out_dir / "fleet_memory.png",
                               {m: r.replay.memory for m, r in runs.items()}, cfg.models,
                               cfg.budget, "memory per model over time: weights (solid) "
                               "and KV (hatched)")
    result["runs"] = {m: r.replay.to_json() for m, r in runs.items()}
    result["total_s"] = time.perf_counter() - t_all
    path = cfg.out_dir / "fleet_results.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"chart: {chart}\nraw results: {path}\nfleet file: "
                  f"{cfg.out_dir / 'FLEET.toml'}\nin {result['total_s']:.0f} s")
    return result


def _config_json(cfg: FleetDemoConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["out_dir"] = str(cfg.out_dir)
    d["resident"] = list(cfg.resident())
    d["weight_bytes"] = {m: cfg.weight_bytes(m) for m in cfg.models}
    return d
