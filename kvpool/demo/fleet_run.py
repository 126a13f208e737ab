"""Demo v2, the main job (``kvpool demo``): six models on a device that holds two.

Six tiny generated Llamas (tens of MiB of fp32 weights each) share one memory budget
that holds the weights and working KV of only two of them at once. A seeded bursty
workload rotates across all six (each model takes its turn peaking; the others get a
trickle), prompt and answer lengths from the Azure 2023 traces (:mod:`workload`). Each
mode serves the same workload, one after the other:

* ``fleet`` — all six through one ``kvpool fleet`` endpoint (:mod:`fleet_launch`), the
  daemon owning the whole budget, weights in the pool, idle models asleep and woken by
  their next request (the fleet's default policy, ``kvpool``);
* ``swap``, ``idle-sleep``, ``reconcile`` (:data:`PEERS`) — the same six through the same
  ``kvpool fleet`` under a peer's policy (issue 36: Ollama / llama-swap, kvcached,
  AIBrix; docs/ARCHITECTURE.md, "Fleet policies"), on a daemon of its own with the same
  budget, with the knobs of :data:`PEER_KNOBS` (each peer's best setting on this workload
  in ``benchmarks/fleet_vs_peers.py``); by default the demo runs :data:`BEST_PEER`, the
  peer that did best there, and its headline is the fleet against the best peer it ran;
* ``static`` — the models that fit (weights + ``working_kv`` each) stay resident, each
  server with a static KV partition of what the budget leaves after their weights;
  requests for the other models fail (no server): what fits on one device, a reference;
* ``elastic`` — the same resident models, weights in the process, their KV elastic
  through a kvpool daemon whose budget is what their weights leave.

Each request is judged against one SLO (:mod:`kvpool.demo.slo`); each mode reports requests served
and failed, SLO attainment, goodput, TTFT p50/p99 (wakes and cold starts included: the
client's clock), wakes and wake latency, member starts and unloads (:mod:`kvpool.demo.wakes`),
and memory per model over time, weights and KV stacked (:mod:`memory_chart`, from the
daemon's ``ps``, the static servers' ``/v1/stats``, or for swap's static members their
footprints while the fleet's ``/v1/models`` shows them loaded).
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
from kvpool.demo.wakes import WakeStats, fleet_log_counts, fleet_metrics, scan_logs
from kvpool.demo.workload import WorkloadShape, generate
from kvpool.sizes import format_size

FLEET = "fleet"  # the fleet under kvpool's own policy
#: the peers' policies, each a mode of its own (the fleet under that policy)
PEERS = ("swap", "idle-sleep", "reconcile")
MODES = (FLEET, *PEERS, "static", "elastic")
NAMES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")
#: each peer's knobs in the demo: its best setting on the demo workload (the rotating
#: shape) in benchmarks/fleet_vs_peers.py (benchmarks/results/fleet_vs_peers.json); the
#: knobs not named keep the policy's defaults. Run of 2026-12-05 (seed 0's sweep, after
#: the fix that counts a member idle from when its server came up): idle-sleep did best
#: with idle_threshold 1 s checked every 0.5 s (84%; 300 s: 46%), reconcile with
#: reconcile_interval 1 s and sleep_after 2 s (76%; defaults: 35%), swap at its defaults
#: (10%; every keep_alive pays 12-16 s server starts)
PEER_KNOBS: dict[str, dict[str, float]] = {
    "swap": {}, "idle-sleep": {"idle_threshold": 1.0, "check_interval": 0.5},
    "reconcile": {"reconcile_interval": 1.0, "sleep_after": 2.0}}
#: the peer with the best SLO attainment on the demo workload there (at its PEER_KNOBS):
#: idle-sleep, 84% on seed 0 (reconcile 76%, swap 10%; the fleet 98%)
BEST_PEER = "idle-sleep"
#: the demo's modes: the fleet and the best peer (static, what fits, with --mode static;
#: dropped from the default to keep the run near 3 minutes)
DEFAULT_MODES = (FLEET, BEST_PEER)


def policy_of(mode: str) -> str:
    """The fleet policy a fleet mode runs (``fleet``: kvpool's own)."""
    return "kvpool" if mode == FLEET else mode


def demo_shape() -> WorkloadShape:
    """The demo's workload: six models taking turns peaking (30 s)."""
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
    # the fleet file's start_timeout_s (every policy): a member not up by then fails (a
    # start takes ~10-25 s on the loaded 2 cores; this bounds what a policy that never
    # frees memory makes a member that cannot load cost the run)
    member_start_timeout_s: float = 30.0
    # TTFT within 1 s (a wake, a prefill and a short queue; one request alone starts in
    # tens of ms) and 100 ms per token (10 tokens/s, faster than reading; one request
    # alone decodes at a few ms per token): see README, "What the demo shows"
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=1.0, tpot_s=0.1))
    workload: WorkloadShape = field(default_factory=demo_shape)
    modes: tuple[str, ...] = DEFAULT_MODES
    # each peer mode's knobs (the rest at the policy's defaults)
    peer_knobs: dict[str, dict[str, float]] = field(
        default_factory=lambda: {k: dict(v) for k, v in PEER_KNOBS.items()})
    live: bool = True
    start_timeout_s: float = 180.0
    # models served from checkpoints of their own (a real model) instead of the generated
    # tiny ones, and each fleet member's engine kind and flags (default: the bundled
    # engine with _engine_args)
    checkpoints: dict[str, Path] = field(default_factory=dict)
    engines: dict[str, str] = field(default_factory=dict)
    engine_args: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def model_dir(self, name: str) -> Path:
        if name in self.checkpoints:
            return self.checkpoints[name]
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
        if name in cfg.checkpoints:
            continue
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
    had a server, how the fleet was started (fleet modes), the policy's knobs, and the
    members a baseline's warm-up could not start."""

    replay: Replay
    wakes: WakeStats
    resident: tuple[str, ...]
    via: str = ""
    knobs: dict[str, float] = field(default_factory=dict)
    not_ready: tuple[str, ...] = ()


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


#: a swap member with a process holds its footprint (``/v1/models`` states)
LOADED_STATES = ("starting", "awake", "asleep", "hung")


def _swap_sampler(url: str, weights: dict[str, int], kv: int
                  ) -> Callable[[], dict[str, Any]]:
    """Swap's members hold their weights and static KV in their own processes, outside
    the daemon: each loaded member (its state in the fleet's ``/v1/models``) counts its
    weights and its static KV, as the policy accounts them."""
    def sample() -> dict[str, Any]:
        try:
            data = httpx.get(f"{url}/v1/models", timeout=5).json().get("data", [])
        except (httpx.HTTPError, ValueError, AttributeError):
            data = []
        states = {str(e.get("id")): str(e.get("state")) for e in data if isinstance(e, dict)}
        loaded = [m for m, st in states.items() if st in LOADED_STATES and m in weights]
        return {"kv": {m: kv for m in loaded}, "weights": {m: weights[m] for m in loaded},
                "state": states}
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
    fleet_mode = mode == FLEET or mode in PEERS
    resident = cfg.models if fleet_mode else cfg.resident()
    weights = {m: cfg.weight_bytes(m) for m in resident}
    env = {"KVPOOL_IDLE_TIMEOUT": str(cfg.idle_timeout_s)}
    kv_budget = cfg.budget - sum(-(-w // cfg.page_size) * cfg.page_size
                                 for w in weights.values())
    via = ""
    knobs: dict[str, float] = {}
    launched: fleet_launch.Launched | None = None
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
            policy = policy_of(mode)
            knobs = dict(cfg.peer_knobs.get(mode, {})) if mode in PEERS else {}
            if mode == FLEET:
                cluster.daemon(cfg.budget, cfg.page_size)
            members = [fleet_launch.Member(m, cfg.model_dir(m).resolve(), cfg.budget,
                                           cfg.budget, cfg.sleep_after_s, cfg.max_num_seqs,
                                           cfg.block_size, cfg.engines.get(m, "bundled"),
                                           cfg.engine_args.get(m, ()))
                       for m in cfg.models]
            toml = cfg.out_dir / ("FLEET.toml" if mode == FLEET else f"FLEET-{mode}.toml")
            launched = fleet_launch.launch(cluster, members, toml, cfg.budget, cfg.page_size,
                                           env, wave=len(cfg.resident()),
                                           timeout_s=cfg.start_timeout_s, policy=policy,
                                           knobs=knobs,
                                           member_start_timeout_s=cfg.member_start_timeout_s,
                                           static_kv=cfg.working_kv)
            urls, via, log_dir = launched.urls, launched.via, launched.log_dir
            metrics_url = launched.metrics_url
            run_dir = launched.run_dir or cluster.run_dir
            assert run_dir is not None
            monitor = Monitor(run_dir)
            if mode == "swap":
                assert metrics_url is not None
                sample = _swap_sampler(metrics_url, weights, cfg.working_kv)
            else:
                sample = _daemon_sampler(monitor, cfg.models, None)
        console.print(f"{mode}: serving {', '.join(urls)}"
                      + (f" ({via}, policy {policy_of(mode)}"
                         + (f": {_knobs_text(knobs)}" if knobs else "") + ")" if via else "")
                      + ("" if len(urls) == len(cfg.models) else
                         f"; requests for {', '.join(m for m in cfg.models if m not in urls)}"
                         f" fail (they do not fit)")
                      + (f"; not started by the policy before the workload: "
                         f"{', '.join(launched.not_ready)}"
                         if launched is not None and launched.not_ready else ""))

        progress = Progress(mode, arrivals, cfg.models, memory_label="memory")

        def sample_and_show() -> dict[str, Any]:
            row = sample()
            progress.memory = {m: row["kv"].get(m, 0) + row["weights"].get(m, 0)
                               for m in cfg.models}
            progress.show()
            return row

        fleet_log = launched.fleet_log if launched is not None else None
        logs_before = scan_logs(log_dir)
        fleet_before = fleet_metrics(metrics_url) if metrics_url else {}
        counts_before = fleet_log_counts(fleet_log)
        with progress.watch(console, cfg.live):
            rep = replay(arrivals, urls, cfg.vocab, sample_memory=sample_and_show,
                         on_done=progress.done)
        fleet_after = fleet_metrics(metrics_url) if metrics_url else {}
        woke = WakeStats.between(logs_before, scan_logs(log_dir), fleet_before,
                                 fleet_after, counts_before, fleet_log_counts(fleet_log))
        if monitor is not None:
            problems = monitor.check()
            monitor.close()
            if problems:
                raise ClusterError(f"the daemon's invariant check failed: {problems}")
        cluster.check_alive()  # a process that died mid-run fails the run
    return ModeRun(rep, woke, tuple(urls), via, knobs,
                   launched.not_ready if launched is not None else ())


def _knobs_text(knobs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(knobs.items()))


def headline(summaries: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The fleet against the best peer policy that ran (None without both): each's SLO
    attainment, which peer, and the ratio (fleet / peer; None when the peer met none)."""
    if FLEET not in summaries:
        return None
    peers = {m: summaries[m]["all"]["slo_attainment"] for m in PEERS if m in summaries}
    if not peers:
        return None
    best = max(peers, key=lambda m: (peers[m], m))
    fleet = summaries[FLEET]["all"]["slo_attainment"]
    return {"fleet_slo": fleet, "best_peer": best, "best_peer_slo": peers[best],
            "ratio": fleet / peers[best] if peers[best] else None}


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
        f"{cfg.slo.tpot_s * 1e3:.0f} ms; modes {', '.join(cfg.modes)}")
    runs: dict[str, ModeRun] = {}
    summaries: dict[str, dict[str, Any]] = {}
    timings: dict[str, float] = {}
    for mode in cfg.modes:
        t0 = time.perf_counter()
        run = run_mode(cfg, mode, console)
        timings[mode] = time.perf_counter() - t0
        runs[mode] = run
        summaries[mode] = slo_report.summarize(run.replay, cfg.slo, cfg.models, run.wakes,
                                               run.resident, budget=cfg.budget,
                                               duration_s=w.duration_s)
        a = summaries[mode]["all"]
        if run.via:
            a["via"] = run.via
        if mode == FLEET or mode in PEERS:
            a["policy"] = policy_of(mode)
            a["knobs"] = run.knobs
            a["not_ready"] = list(run.not_ready)
        console.print(f"{mode}: {a['served']}/{a['requests']} served, SLO met "
                      f"{a['slo_attainment']:.0%}, in {timings[mode]:.0f} s")
    console.print(slo_report.table(f"{len(cfg.models)} models, budget {format_size(cfg.budget)}: "
                            f"SLO TTFT <= {cfg.slo.ttft_s * 1e3:.0f} ms, TPOT <= "
                            f"{cfg.slo.tpot_s * 1e3:.0f} ms (times in ms)", summaries))
    result: dict[str, Any] = {"config": _config_json(cfg), "summary": summaries,
                              "timings_s": timings}
    head = headline(summaries)
    if head is not None:
        result["headline"] = head
        result["slo_ratio_fleet_over_best_peer"] = head["ratio"]
        fleet = summaries[FLEET]["all"]
        peer = head["best_peer"]
        console.print(f"SLO attainment: fleet {head['fleet_slo']:.0%} vs the best peer, "
                      f"{peer} ({_knobs_text(runs[peer].knobs) or 'its defaults'}), "
                      f"{head['best_peer_slo']:.0%} ("
                      f"{'-' if head['ratio'] is None else format(head['ratio'], '.1f')}x); "
                      f"fleet served "
                      f"{fleet['models_served']}/{fleet['models']} models, {peer} "
                      f"{summaries[peer]['all']['models_served']}/{fleet['models']}")
    if FLEET in summaries and "static" in summaries:
        st = summaries["static"]["all"]["slo_attainment"]
        result["slo_ratio_fleet_over_static"] = (
            summaries[FLEET]["all"]["slo_attainment"] / st if st else None)
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
    d["peer_knobs"] = {m: k for m, k in cfg.peer_knobs.items() if m in cfg.modes}
    d["out_dir"] = str(cfg.out_dir)
    d["resident"] = list(cfg.resident())
    d["weight_bytes"] = {m: cfg.weight_bytes(m) for m in cfg.models}
    return d
