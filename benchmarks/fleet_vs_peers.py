"""The fleet against the peers' policies on the same work and memory (issue 36 item 4).

``kvpool fleet`` under its own policy (``kvpool``) and under each peer's (``swap``:
Ollama / llama-swap; ``idle-sleep``: kvcached; ``reconcile``: AIBrix ModelClaim;
docs/ARCHITECTURE.md, "Fleet policies"), on the demo's six tiny models, its budget (the
weights and working KV of two), its SLO and its replay (:mod:`kvpool.demo.fleet_run`:
each run is one of the demo's fleet modes, started as the demo starts it). Shapes:

* ``rotating`` — the demo's workload: each model in turn peaks (3 req/s for 5 s), the
  others get 0.1 req/s (30 s);
* ``steady`` — mixed traffic: every model at the same constant rate (0.4 req/s, 30 s);
* ``long-tail`` — two models take most requests, four are rarely used (Zipf-like
  constant rates 1.2, 0.5, 0.15, 0.1, 0.06, 0.06 req/s, 30 s);
* ``smollm2`` — SmolLM2-135M as three members (bundled fp32, bundled bf16, vLLM bf16)
  taking turns (0.6 req/s bursts of 10 s, 0.03 between, 60 s) on a 640 MiB budget of
  2 MiB pages that holds one bundled member's weights at a time (:func:`shape_config`).

Each peer runs at its default knobs and at a sweep of its main knob (``keep_alive``,
``idle_threshold``, ``reconcile_interval``; the sweep also shortens the timer that lets
that knob act inside a 30 s run: idle-sleep's ``check_interval``, reconcile's
``sleep_after``, each named in the JSON); the fleet too (kvpool's ``sleep_after``, a
member's idle seconds before it sleeps: the demo's 2 s and 1 s, idle-sleep's best
threshold). The sweep runs on the first seed; the best
setting per shape (SLO attainment, then goodput) then runs with the default on every
other seed. Within a seed the policies run in turn (kvpool, swap, idle-sleep,
reconcile), so machine load drifts across all of them alike. Order: the first seed of
every shape, then the other seeds shape by shape (the demo's first), so that a run
stopped early has every shape's sweep. Every policy's members get
the same ``start_timeout_s`` (:data:`MEMBER_START_TIMEOUT_S`).

Per run: SLO attainment, goodput, TTFT p50/p99 (the client's clock: wakes and cold
starts included), wakes, member starts (cold starts) and unloads, memory peak and
over-commit (bytes held above the budget x seconds). Writes
``benchmarks/results/fleet_vs_peers.json`` (every seed and setting, after every run) and
``fleet_vs_peers.png`` (SLO attainment per policy per shape), and prints the table.

    .venv/bin/python benchmarks/fleet_vs_peers.py --quick        # a few minutes
    .venv/bin/python benchmarks/fleet_vs_peers.py                 # 3 shapes x 3 seeds
    .venv/bin/python benchmarks/fleet_vs_peers.py --shapes rotating --seeds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, log, smollm2, write_result  # noqa: E402

from kvpool.demo import slo as slo_report  # noqa: E402
from kvpool.demo.fleet_run import (FLEET, PEERS, FleetDemoConfig, demo_shape,  # noqa: E402
                                   ensure_models, run_mode)
from kvpool.demo.slo import Slo  # noqa: E402
from kvpool.demo.workload import WorkloadShape  # noqa: E402

POLICIES = ("kvpool", *PEERS)


#: the real-model shape's members: SmolLM2-135M as a bundled fp32 member, a bundled
#: bfloat16 member (the same model converted: weights of their own) and a vLLM member
SMOL_MODELS = ("smol-32", "smol-16", "smol-vllm")
#: the vLLM member's flags (its weights local: vLLM keeps them in its own memory)
SMOL_VLLM_ARGS = ("--enforce-eager", "--max-model-len", "512", "--dtype", "bfloat16")


def shapes(quick: bool) -> dict[str, WorkloadShape]:
    """Every shape (``quick``: 10 s each, the same rates; ``smollm2``: 20 s)."""
    rot = demo_shape()
    models = list(rot.models)
    out = {
        "rotating": rot,
        "steady": dataclasses.replace(rot, rates=(0.4,) * len(models)),
        "long-tail": dataclasses.replace(rot, rates=(1.2, 0.5, 0.15, 0.1, 0.06, 0.06)),
        # SmolLM2 members taking turns (10 s each, twice): bursts a model of 135M
        # parameters serves on 2 shared cores (at 1 req/s, 0.1 between turns and prompts
        # to 128 tokens every policy's queues outgrew the run on the loaded machine),
        # shorter prompts and answers than the tiny models'
        "smollm2": WorkloadShape(models=list(SMOL_MODELS), duration_s=60.0, phase_s=10.0,
                                 base_rate=0.03, peak_rate=0.6, prompt_scale=8.0,
                                 output_scale=4.0, prompt_range=(16, 96),
                                 output_range=(8, 32)),
    }
    if quick:
        out = {k: dataclasses.replace(v, duration_s=10.0, phase_s=10.0 / len(models))
               if k != "smollm2" else dataclasses.replace(v, duration_s=20.0, phase_s=10.0 / 3)
               for k, v in out.items()}
    return out


def bf16_variant(src: Path, dst: Path) -> Path:
    """``src`` (a float32 checkpoint) converted to bfloat16 into ``dst`` (once)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors", ".kvpool-*"))
    for f in src.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(f).items()},
                  tmp / f.name, metadata={"format": "pt"})
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(dst)
    return dst


def shape_config(shape: str, cache: Path) -> dict[str, Any]:
    """The :class:`FleetDemoConfig` fields a shape sets beyond the demo's (the tiny
    shapes: none). ``smollm2``: the three SmolLM2 members on 2 MiB pages (a GPU's page) and
    a budget that holds the fp32 member's weights and working KV, or the bf16 member's and
    the vLLM member's KV, not both bundled members (the vLLM member's weights are local,
    outside every policy's budget alike); an SLO for a 135M model on 2 shared cores: the
    first token within 5 s (a wake that reloads 514 MiB of weights while another member
    is put to sleep took 3.7-5.8 s in a trial on the loaded cores; a prefill and a short
    queue), then 4 tokens a second; members get 180 s to start (vLLM's start on the loaded cores)."""
    if shape != "smollm2":
        return {}
    fp32 = smollm2(cache)
    bf16 = bf16_variant(fp32, cache / "SmolLM2-135M-Instruct-bf16")
    return {"models": SMOL_MODELS,
            "checkpoints": {"smol-32": fp32, "smol-16": bf16, "smol-vllm": bf16},
            "engines": {"smol-vllm": "vllm"}, "engine_args": {"smol-vllm": SMOL_VLLM_ARGS},
            "budget": 640 << 20, "page_size": 2 << 20, "working_kv": 64 << 20,
            "max_num_seqs": 8, "vocab": 512, "slo": Slo(ttft_s=5.0, tpot_s=0.25),
            "member_start_timeout_s": 180.0, "start_timeout_s": 600.0}


#: per policy: (label, knobs) — the default first, then the sweep of its main knob
SETTINGS: dict[str, list[tuple[str, dict[str, float]]]] = {
    "kvpool": [("default", {}), ("sleep_after=1", {"sleep_after": 1.0})],
    "swap": [("default", {}), ("keep_alive=2", {"keep_alive": 2.0}),
             ("keep_alive=10", {"keep_alive": 10.0})],
    "idle-sleep": [("default", {}),
                   ("idle_threshold=1", {"idle_threshold": 1.0, "check_interval": 0.5}),
                   ("idle_threshold=4", {"idle_threshold": 4.0, "check_interval": 0.5})],
    "reconcile": [("default", {}),
                  ("reconcile_interval=1", {"reconcile_interval": 1.0, "sleep_after": 2.0}),
                  ("reconcile_interval=4", {"reconcile_interval": 4.0, "sleep_after": 2.0})],
}
#: the fleet file's start_timeout_s for every policy here: a member not up by then
#: fails (a member starts in ~10 s on the loaded 2 cores; 30 s bounds what a policy that
#: never frees memory, idle-sleep at its defaults, makes a waiting member cost a run)
MEMBER_START_TIMEOUT_S = 30.0  # (the demo's default too)
GOAL = {"rotating": 2.0}  # fleet SLO / best-tuned peer's, per seed (else 1.0)


def mode_of(policy: str) -> str:
    return FLEET if policy == "kvpool" else policy


def one_run(out: Path, shape: WorkloadShape, seed: int, policy: str,
            knobs: dict[str, float], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One fleet run: the demo's fleet mode of ``policy`` with ``knobs`` on ``shape``
    (``extra``: the shape's own config fields, :func:`shape_config`)."""
    from rich.console import Console

    mode = mode_of(policy)
    fields: dict[str, Any] = {"member_start_timeout_s": MEMBER_START_TIMEOUT_S,
                              **(extra or {})}
    cfg = FleetDemoConfig(out_dir=out, live=False, modes=(mode,),
                          workload=dataclasses.replace(shape, seed=seed), **fields)
    if policy != "kvpool":
        cfg.peer_knobs = {policy: dict(knobs)}
    elif "sleep_after" in knobs:  # (kvpool's knob: a member's idle time before it sleeps)
        cfg.sleep_after_s = knobs["sleep_after"]
    t0 = time.perf_counter()
    run = run_mode(cfg, mode, Console(file=sys.stderr, width=120))
    summary = slo_report.summarize(run.replay, cfg.slo, cfg.models, run.wakes, run.resident,
                                   budget=cfg.budget, duration_s=cfg.workload.duration_s)
    a = summary["all"]
    missed = [o for o in run.replay.outcomes if not cfg.slo.met(o)]
    a["missed"] = {
        "failed": sum(1 for o in missed if o.error is not None),
        "ttft_over": sum(1 for o in missed if o.error is None and o.ttft is not None
                         and o.ttft > cfg.slo.ttft_s),
        "tpot_over": sum(1 for o in missed if o.error is None and o.tpot is not None
                         and o.tpot > cfg.slo.tpot_s
                         and (o.ttft is None or o.ttft <= cfg.slo.ttft_s)),
        "errors": sorted({(o.error or "")[:80] for o in missed if o.error})[:5],
    }
    a["not_ready"] = list(run.not_ready)
    per_model = {m: {k: summary[m][k] for k in ("requests", "slo_met", "failed")}
                 for m in cfg.models}
    return {"all": a, "per_model": per_model, "wall_s": time.perf_counter() - t0,
            "budget": cfg.budget}


def _mean(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.fmean(ys) if ys else None


def aggregate(runs: list[dict[str, Any]], shape: str, policy: str, label: str
              ) -> dict[str, Any] | None:
    mine = [r for r in runs if (r["shape"], r["policy"], r["setting"]) == (shape, policy, label)]
    if not mine:
        return None
    a = [r["result"]["all"] for r in mine]
    slo = [x["slo_attainment"] for x in a]
    return {
        "setting": label, "knobs": mine[0]["knobs"], "seeds": [r["seed"] for r in mine],
        "slo_mean": statistics.fmean(slo), "slo_min": min(slo), "slo_max": max(slo),
        "slo_per_seed": slo,
        "goodput_req_s": _mean([x.get("goodput_req_s") for x in a]),
        "goodput_tok_s": _mean([x.get("goodput_tok_s") for x in a]),
        "ttft_p50_s": _mean([x["ttft_p50"] for x in a]),
        "ttft_p99_s": _mean([x["ttft_p99"] for x in a]),
        "cold_starts": _mean([x["wakes"].get("cold_starts") for x in a]),
        "wakes": _mean([x["wakes"].get("fleet_wakes", x["wakes"]["count"]) for x in a]),
        "unloads": _mean([x["wakes"].get("unloads") for x in a]),
        "mem_peak": max(x["mem_peak"] for x in a),
        "over_commit_byte_s": max(x.get("over_commit_byte_s", 0.0) for x in a),
        "failed": _mean([x["failed"] for x in a]),
    }


def best_setting(runs: list[dict[str, Any]], shape: str, policy: str, sweep_seed: int
                 ) -> str:
    """The setting of ``policy`` with the best SLO attainment (then goodput) on
    ``shape`` at the sweep seed."""
    cands = [r for r in runs if (r["shape"], r["policy"], r["seed"]) == (shape, policy,
                                                                         sweep_seed)]
    if not cands:
        return "default"
    best = max(cands, key=lambda r: (r["result"]["all"]["slo_attainment"],
                                     r["result"]["all"].get("goodput_req_s") or 0.0,
                                     r["setting"] == "default"))
    return str(best["setting"])


def verdicts(runs: list[dict[str, Any]], best: dict[str, dict[str, str]],
             seeds: list[int]) -> dict[str, Any]:
    """Per shape: the fleet's SLO (at its best setting) over the best-tuned peer's, per
    seed (the best peer of that seed at its best setting), against the goal."""
    out: dict[str, Any] = {}
    for shape in best:
        per_seed = []
        for seed in seeds:
            def slo_of(policy: str, label: str) -> float | None:
                got = [r for r in runs if (r["shape"], r["policy"], r["setting"], r["seed"])
                       == (shape, policy, label, seed)]
                return got[0]["result"]["all"]["slo_attainment"] if got else None
            fleet = slo_of("kvpool", best[shape].get("kvpool", "default"))
            peers = {p: slo_of(p, best[shape].get(p, "default")) for p in PEERS}
            have = {p: v for p, v in peers.items() if v is not None}
            if fleet is None or not have:
                continue
            top = max(have, key=lambda p: have[p])
            per_seed.append({"seed": seed, "fleet": fleet,
                             "fleet_setting": best[shape].get("kvpool", "default"),
                             "best_peer": top,
                             "best_peer_setting": best[shape].get(top, "default"),
                             "best_peer_slo": have[top],
                             "ratio": fleet / have[top] if have[top] else None})
        goal = GOAL.get(shape, 1.0)
        met = bool(per_seed) and all(x["ratio"] is None or x["ratio"] >= goal
                                     for x in per_seed)
        out[shape] = {"goal_ratio": goal, "per_seed": per_seed, "goal_met": met}
    return out


def table(doc: dict[str, Any]) -> str:
    lines = ["shape      policy      setting                 seeds SLO mean (min-max)  "
             "goodput  TTFT p50/p99 ms  cold starts  wakes  mem peak MiB"]
    for shape, pols in doc["aggregate"].items():
        for policy, rows in pols.items():
            for which, row in rows.items():
                if row is None:
                    continue
                lines.append(
                    f"{shape:<10} {policy:<11} {which[:7] + ':' + row['setting']:<23} "
                    f"{len(row['seeds']):>5} {row['slo_mean']:>6.0%} "
                    f"({row['slo_min']:.0%}-{row['slo_max']:.0%})  "
                    f"{(row['goodput_req_s'] or 0):>5.2f}/s "
                    f"{(row['ttft_p50_s'] or 0) * 1e3:>6.0f}/{(row['ttft_p99_s'] or 0) * 1e3:<7.0f} "
                    f"{'-' if row['cold_starts'] is None else format(row['cold_starts'], '.1f'):>11} "
                    f"{'-' if row['wakes'] is None else format(row['wakes'], '.1f'):>6} "
                    f"{row['mem_peak'] / 2**20:>8.0f}")
    for shape, v in doc["verdicts"].items():
        ratios = ", ".join(f"seed {x['seed']}: {x['fleet']:.0%} vs {x['best_peer']} "
                           f"{x['best_peer_slo']:.0%} = "
                           f"{'-' if x['ratio'] is None else format(x['ratio'], '.2f')}x"
                           for x in v["per_seed"])
        lines.append(f"{shape}: fleet / best-tuned peer (goal >= {v['goal_ratio']:g}x): "
                     f"{ratios or 'no complete seed'}; goal "
                     f"{'met' if v['goal_met'] else 'NOT met'}")
    return "\n".join(lines)


def chart(doc: dict[str, Any], path: Path) -> Path:
    """SLO attainment per policy per shape: the mean over seeds (bars: default hatched,
    best setting solid), each seed a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"kvpool": "tab:blue", "swap": "tab:orange", "idle-sleep": "tab:green",
               "reconcile": "tab:red"}
    bars = [("kvpool", "best")] + [(p, w) for p in PEERS for w in ("default", "best")]
    shapes_ = list(doc["aggregate"])
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(bars)
    for j, (policy, which) in enumerate(bars):
        xs, ys, dots_x, dots_y = [], [], [], []
        for i, shape in enumerate(shapes_):
            row = doc["aggregate"][shape].get(policy, {}).get(which)
            if row is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            xs.append(x)
            ys.append(row["slo_mean"])
            dots_x += [x] * len(row["slo_per_seed"])
            dots_y += row["slo_per_seed"]
        label = "kvpool fleet" if policy == "kvpool" else f"{policy} ({which})"
        ax.bar(xs, ys, width, color=colours[policy], label=label,
               hatch="//" if which == "default" else "", alpha=0.5 if which == "default"
               else 0.9, edgecolor="black", linewidth=0.5)
        ax.scatter(dots_x, dots_y, s=8, color="black", zorder=3)
    ax.set_xticks(range(len(shapes_)), shapes_)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("SLO attainment")
    ax.set_title("kvpool fleet vs the peers' policies: SLO attainment (mean over seeds; "
                 "dots: each seed)", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08),
              frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def document(runs: list[dict[str, Any]], shape_names: list[str], seeds: list[int],
             best: dict[str, dict[str, str]], args: argparse.Namespace,
             started: float) -> dict[str, Any]:
    agg: dict[str, Any] = {}
    for shape in shape_names:
        agg[shape] = {}
        for policy in POLICIES:
            b = best.get(shape, {}).get(policy, "default")
            agg[shape][policy] = {"default": aggregate(runs, shape, policy, "default"),
                                  "best": aggregate(runs, shape, policy, b)}
    doc = {"settings": {p: [{"label": label, "knobs": k} for label, k in s]
                        for p, s in SETTINGS.items()},
           "shapes": {k: dataclasses.asdict(v) for k, v in shapes(args.quick).items()
                      if k in shape_names},
           "seeds": seeds, "sweep_seed": seeds[0], "quick": args.quick,
           "best_setting": best, "aggregate": agg,
           "verdicts": verdicts(runs, {s: best.get(s, {}) for s in shape_names
                                       if s in best}, seeds),
           "runs": runs, "elapsed_s": time.perf_counter() - started,
           "note": "each run is one fleet mode of the demo (kvpool demo): its six tiny "
                   "models, or (smollm2) SmolLM2-135M as bundled fp32, bundled bf16 and "
                   "vLLM members; the sweep runs on the first seed, the best setting and "
                   "the default on every seed"}
    return doc


def merge(args: argparse.Namespace) -> None:
    """``--merge``: the runs of several result files in one document (see ``--merge``)."""
    import json

    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    notes = []
    for f in args.merge:
        d = json.loads(Path(f).read_text())
        for r in d["runs"]:  # a later file's run replaces an earlier one of the same key
            by_key[(r["shape"], r["seed"], r["policy"], r["setting"])] = r
        notes.append(f"{f}: {d['command']} ({d['when']}, {len(d['runs'])} runs)")
    runs = list(by_key.values())
    names = list(dict.fromkeys(r["shape"] for r in runs))
    seeds = sorted({int(r["seed"]) for r in runs})
    best = {shape: {p: best_setting(runs, shape, p, seeds[0]) for p in POLICIES}
            for shape in names}
    doc = document(runs, names, seeds, best, args, time.perf_counter())
    doc["merged_from"] = notes
    out = Path(args.out) if args.out else RESULTS / "fleet_vs_peers.json"
    write_result(out.stem, doc, str(out))
    chart(doc, out.with_suffix(".png"))
    print(table(doc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 s shapes, one seed, the "
                    "default and one sweep value per peer")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 [3; --quick: 1]")
    ap.add_argument("--seeds-from", type=int, default=0, help="the first seed [0]")
    ap.add_argument("--no-sweep", action="store_true", help="each policy at its defaults "
                    "only (a later invocation's seeds of a shape whose best settings were "
                    "its defaults; join them with --merge)")
    ap.add_argument("--sweep-only", action="store_true",
                    help="the sweep's values alone, no defaults (their defaults ran in an "
                    "earlier invocation; join them with --merge); with --best-from: the "
                    "recorded best settings alone")
    ap.add_argument("--best-from", default=None, metavar="JSON",
                    help="no sweep: each peer at its default and at the best setting that "
                    "result file recorded for the shape (later seeds of an earlier sweep; "
                    "join them with --merge)")
    ap.add_argument("--shapes", default="rotating,steady,long-tail,smollm2",
                    help="comma-separated: rotating, steady, long-tail, smollm2")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) /
                    "kvpool-models", help="where SmolLM2 is converted (once) for the "
                    "smollm2 shape")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--models-dir", default="demo-out", help="where the demo's models are "
                    "(written there once: fleet-models/) and the runs' logs go")
    ap.add_argument("--out", default=None, help="JSON path [benchmarks/results/"
                    "fleet_vs_peers.json; --quick: ..._quick.json]")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: join the runs of these result files (runs of one "
                    "shape cut into several invocations, or run side by side) into --out, "
                    "the best settings and the verdicts computed again")
    args = ap.parse_args()
    if args.merge:
        merge(args)
        return
    all_shapes = shapes(args.quick)
    shape_names = [s for s in args.shapes.split(",") if s]
    policies = [p for p in args.policies.split(",") if p]
    for s in shape_names:
        if s not in all_shapes:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(all_shapes)}")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    n = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    seeds = list(range(args.seeds_from, args.seeds_from + n))
    if not seeds:
        ap.error("--seeds must be at least 1")
    settings = {p: (SETTINGS[p][:1] if args.no_sweep else SETTINGS[p][:2] if args.quick
                    else SETTINGS[p]) for p in policies}
    if args.sweep_only:
        settings = {p: [x for x in SETTINGS[p] if x[0] != "default"] for p in policies}
    out_json = Path(args.out) if args.out else RESULTS / (
        "fleet_vs_peers_quick.json" if args.quick else "fleet_vs_peers.json")
    out = Path(args.models_dir)
    ensure_models(FleetDemoConfig(out_dir=out))
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []

    def save() -> None:
        doc = document(runs, shape_names, seeds, best, args, started)
        write_result(out_json.stem, doc, str(out_json))
        chart(doc, out_json.with_suffix(".png"))

    # every shape's first seed (its sweep), then the first shape's other seeds (the
    # demo's workload), then the others': a run cut short has every shape's sweep
    schedule = [(shape, seeds[0]) for shape in shape_names]
    schedule += [(shape, seed) for shape in shape_names for seed in seeds[1:]]
    best = {shape: {p: "default" for p in policies} for shape in shape_names}
    if args.best_from:
        import json

        try:
            recorded = json.loads(Path(args.best_from).read_text())["best_setting"]
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--best-from {args.best_from}: no recorded best settings ({e})")
        labels = {p: dict(SETTINGS[p]) for p in policies}
        for shape in shape_names:
            for p in policies:
                label = recorded.get(shape, {}).get(p, "default")
                if label not in labels[p]:
                    ap.error(f"{args.best_from}: unknown setting {label!r} of {p}")
                best[shape][p] = label
        settings = {p: [s for s in SETTINGS[p] if s[0] in
                        {"default", *(best[sh][p] for sh in shape_names)}
                        and not (args.sweep_only and s[0] == "default")]
                    for p in policies}
    for shape, seed in schedule:
        for policy in policies:
            todo = settings[policy] if seed == seeds[0] and not args.best_from else [
                s for s in settings[policy] if s[0] in ("default", best[shape][policy])]
            for label, knobs in todo:
                log(f"[{time.perf_counter() - started:.0f} s] {shape} seed {seed}: "
                    f"{policy} {label}")
                result = one_run(out, all_shapes[shape], seed, policy, knobs,
                                 shape_config(shape, args.cache))
                a = result["all"]
                log(f"  SLO {a['slo_attainment']:.0%} ({a['slo_met']}/{a['requests']}), "
                    f"failed {a['failed']}, TTFT p99 {(a['ttft_p99'] or 0) * 1e3:.0f} ms, "
                    f"starts {a['wakes'].get('cold_starts')}, wakes "
                    f"{a['wakes'].get('fleet_wakes')}, in {result['wall_s']:.0f} s")
                runs.append({"shape": shape, "seed": seed, "policy": policy,
                             "setting": label, "knobs": knobs, "result": result})
                save()
        if seed == seeds[0] and not args.best_from:
            best[shape] = {p: best_setting(runs, shape, p, seed) for p in policies}
            log(f"{shape}: best settings {best[shape]}")
            save()
    doc = document(runs, shape_names, seeds, best, args, started)
    print(table(doc))
    log(f"wrote {out_json} and {out_json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
