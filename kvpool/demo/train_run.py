"""``kvpool demo --scenario train``: a reinforcement-learning loop that learns, colocated
on one kvpool budget (:mod:`kvpool.demo.rl_loop`): a daemon, one elastic ``kvpool serve``
of a tiny generated model with its weights in the pool (the rollout engine), and this
process as a trainer tenant whose policy, gradients and Adam state are pool pages.

Each step: rollout (the engine's KV grows), the trainer's step memory granted (the daemon
takes the idle engine's KV, the weights stay), a GRPO update, the step memory given back,
the new weights published: in place (the policy's parameters are the engine's weights, a
mutable set the update writes into its back buffer; the engine remaps to the new version,
no byte copied), or, when the layouts differ, by a checkpoint the engine loads. Writes ``train_results.json`` (per step: reward, seconds per phase, bytes copied,
memory per tenant) and ``train_memory.png`` into the output folder; ``kvpool check``
must be clean at the end.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvpool.demo.cluster import Cluster, ClusterError
from kvpool.sizes import format_size

ENGINE = "engine"
TRAINER = "trainer"


@dataclass
class TrainDemoConfig:
    """A run; the defaults take about a minute on 2 CPU cores."""

    out_dir: Path = Path("demo-out")
    budget: int = 16 << 20  # everything: the engine's weights and KV, the trainer's state
    page_size: int = 64 << 10
    # the tiny model the loop's learning rate was chosen on (kvpool.demo.rl_loop)
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    engine_keep: int = 256 << 10  # KV the engine keeps while the trainer steps
    trainer_shares: float = 64.0  # its fair share covers its state and step: the daemon
    # then takes the KV beyond the engine's small share back for the step
    checkpoint: Path | None = None  # a real checkpoint (e.g. SmolLM2) instead of the tiny one
    loop: Any = None  # LoopConfig (made on use: the loop imports torch)
    log: Callable[[str], None] = print
    extra_serve_env: dict[str, str] = field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return self.checkpoint or self.out_dir / "models" / "policy"


def ensure_model(cfg: TrainDemoConfig) -> Path:
    """The checkpoint the loop starts from: the configured one, or the tiny one (written
    once, kept between runs)."""
    from kvpool.engine.model.tiny import make_tiny_model

    if cfg.checkpoint is None and not (cfg.model_dir / "config.json").exists():
        make_tiny_model(cfg.model_dir, layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                        kv_heads=cfg.kv_heads, vocab=512, seed=0)
    return cfg.model_dir


def start(cluster: Cluster, cfg: TrainDemoConfig, env: dict[str, str] | None = None,
          extra: tuple[str, ...] = (), kv_cache_size: int | None = None) -> str:
    """The daemon and the rollout engine (weights in the pool; its KV's virtual size
    ``kv_cache_size``, default the budget); returns its URL."""
    cluster.daemon(cfg.budget, cfg.page_size)
    proc = cluster.serve(ENGINE, ensure_model(cfg), kv_cache_size or cfg.budget,
                         elastic=True, weights="pool",
                         env={"KVPOOL_IDLE_TIMEOUT": "3600", **(env or {})},
                         extra=("--device", "cpu", "--max-model-len", "512", *extra))
    cluster.wait_healthy(180)
    assert proc.url is not None
    return proc.url


def kv_step_bytes(cfg: TrainDemoConfig,
                  weights: int | Callable[[], int]) -> Callable[[Any], int]:
    """The trainer's step in kvpool's mode: all the budget but the engine's weights (or
    what ``weights()`` says then: in place, the mutable set's two buffers), the trainer's
    own state and ``engine_keep`` of KV (whole pages)."""
    def size(trainer: Any) -> int:
        w = weights() if callable(weights) else weights
        n = cfg.budget - w - trainer.held_bytes - cfg.engine_keep
        n -= n % cfg.page_size
        if n <= 0:
            raise RuntimeError(
                f"the budget ({format_size(cfg.budget)}) leaves the trainer's step no room "
                f"beside the engine's weights ({format_size(w)}), the trainer's state "
                f"({format_size(trainer.held_bytes)}) and the KV the engine keeps "
                f"({format_size(cfg.engine_keep)}): give a larger --budget")
        return int(n)
    return size


def engine_weights(mon: Any) -> int:
    """The pool bytes of weight sets the engine holds now."""
    return int({t.name: t.weights for t in mon.ps().tenants}[ENGINE])


def run_train_demo(cfg: TrainDemoConfig) -> dict[str, Any]:
    """Run the loop (see the module); returns what it wrote to ``train_results.json``.
    A process that fails raises :class:`ClusterError`."""
    from kvpool.client_lib import Monitor
    from kvpool.client_lib.trainer import connect_trainer
    from kvpool.demo.rl_loop import KvSwitch, Loop, LoopConfig

    loop_cfg = cfg.loop or LoopConfig()
    out = cfg.out_dir
    with Cluster(out / "logs" / "train") as cluster:
        url = start(cluster, cfg, cfg.extra_serve_env)
        assert cluster.run_dir is not None
        with Monitor(cluster.run_dir) as mon, \
                connect_trainer(TRAINER, run_dir=cluster.run_dir, shares=cfg.trainer_shares,
                                wait_s=60) as tr:
            held = {"weights": engine_weights(mon)}
            switch = KvSwitch(url, kv_step_bytes(cfg, lambda: held["weights"]))
            loop = Loop(loop_cfg, url, ENGINE, cfg.model_dir, tr, mon, switch,
                        out / "checkpoints", on_step=lambda r: _line(cfg, r), in_place=True)
            held["weights"] = weights = engine_weights(mon)  # in place: the mutable set
            in_place = loop.inplace is not None
            cfg.log("weights published in place (a mutable set of the engine's layout)"
                    if in_place else
                    f"weights published by checkpoint ({loop.in_place_why})")
            t0 = time.monotonic()
            try:
                records = loop.run()
            finally:
                loop.close()
            elapsed = time.monotonic() - t0
            problems = mon.check()
            cluster.check_alive()
        result = {
            "model": str(cfg.checkpoint) if cfg.checkpoint else "tiny",
            "budget": cfg.budget, "page_size": cfg.page_size, "loop": asdict(loop_cfg),
            "engine_keep": cfg.engine_keep,
            "policy_bytes": loop.policy.nbytes, "engine_weights": weights,
            "in_place": in_place, "in_place_why": loop.in_place_why,
            "seconds": elapsed, "check": problems,
            "reward_first": records[0].reward, "reward_last": records[-1].reward,
            "steps": [r.as_dict() for r in records]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_results.json").write_text(json.dumps(result, indent=1))
    chart_path = chart(out / "train_memory.png", records, cfg.budget)
    cfg.log(f"reward {records[0].reward:.3f} -> {records[-1].reward:.3f} over "
            f"{len(records)} steps; kvpool check: {problems or 'clean'}; "
            f"wrote {out / 'train_results.json'}, {chart_path}")
    if problems:
        raise ClusterError(f"kvpool check found problems: {problems}")
    return result


def _line(cfg: TrainDemoConfig, r: Any) -> None:
    during = r.held_train
    cfg.log(f"step {r.step:3d}  reward {r.reward:.3f}  rollout {r.rollout_s:.2f}s  "
            f"switch {r.to_train_s:.3f}s/{r.to_rollout_s:.3f}s  train {r.train_s:.2f}s  "
            f"publish {r.publish_s:.2f}s  weights copied {format_size(r.weights_copied)}  "
            f"engine kv {format_size(during.get(ENGINE, {}).get('mapped', 0))} while training")


def chart(path: Path, records: list[Any], budget: int) -> Path:
    """Memory per tenant over the run: after each rollout and during each update."""
    from kvpool.demo.memory_chart import chart as draw

    rows: list[dict[str, Any]] = []
    t = 0.0
    for r in records:
        phases = ((r.held_rollout, r.rollout_s),
                  (r.held_train, r.to_train_s + r.train_s + r.to_rollout_s + r.publish_s))
        for snap, dt in phases:  # each snapshot held for its phase: a plateau
            row = {"weights": {n: h["weights"] for n, h in snap.items()},
                   "kv": {n: h["mapped"] for n, h in snap.items()}}
            rows += [{"t": t, **row}, {"t": t + dt, **row}]
            t += dt
    return draw(path, {"kvpool (engine KV shrinks for the step, weights stay)": rows},
                [ENGINE, TRAINER], budget,
                "RL loop on one budget: engine weights and KV, trainer state and step")
