"""Colocated RL loop: kvpool's switch vs sleep/wake and a static split (issue 37 item 5).

The same loop (:mod:`kvpool.demo.rl_loop`: rollouts through an elastic ``kvpool serve`` of
the tiny model, weights in the pool; a GRPO step of a trainer tenant whose policy, grads
and Adam state are pool pages; the new weights published by ``POST /kvpool/weights``), the
same budget and seeds, four ways of handing the memory over, each on its own daemon and
engine, run interleaved (cycle k of every mode before cycle k+1 of any):

* ``kvpool``  — no sleep: the trainer's step grant makes the daemon take the idle engine's
  KV, its weights stay mapped; the step's end gives the memory back, the engine grows on
  demand; the weights are published in place (the policy's parameters are the engine's
  weights, a mutable set: the update is written into its back buffer and the engine
  remaps to the new version; no checkpoint, no byte of weights copied;
  ``--kvpool-copy`` publishes by checkpoint instead, as the baselines do);
* ``sleep1``  — sleep level 1 as the RL frameworks use it: the engine sleeps (KV dropped,
  weights released), the trainer's step gets everything the engine held, the engine wakes
  (its weights back by copy: this engine reloads its current checkpoint, the host copy,
  once the step evicted the released set) and the new weights are then synced by copy
  (the publish). The frameworks' device-to-host copy at sleep is not made here: the host
  copy already exists as the trainer's checkpoint (so this baseline is cheaper than theirs
  by one copy of the weights);
* ``sleep2``  — sleep level 2: weights dropped, the publish made while asleep, the wake
  creates the new set from the trainer's checkpoint (one copy);
* ``static``  — a static split: the engine's KV capped at ``--static-kv`` (its virtual KV
  size), the trainer's step the rest; nothing switches.

Per mode: step seconds; the switch each way next to the memcpy floor of the bytes that
must move in that switch (a plain ``torch`` copy of that many bytes, measured in this
run; for kvpool the KV pages that change owner, which are zeroed, not copied); the share
of the step spent switching; bytes copied per step (the checkpoint written, the set
loaded, a wake's reload; of which weights: ``weights_copied_per_step``); each tenant's pool bytes after every cycle (residual growth:
last vs first); the engine's and daemon's resident memory after every cycle and the host peak.

    .venv/bin/python benchmarks/train_colocate_bench.py [--cycles 100] \
        [--modes kvpool,sleep1,sleep2,static]

Writes benchmarks/results/train_colocate.json and train_colocate.png.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
from dataclasses import asdict
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import httpx  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from common import RESULTS, best_s, write_result  # noqa: E402
from kvpool.client_lib import Monitor  # noqa: E402
from kvpool.client_lib.trainer import Trainer, connect_trainer  # noqa: E402
from kvpool.demo.cluster import Cluster  # noqa: E402
from kvpool.demo.rl_loop import Back, KvSwitch, Loop, LoopConfig, publish  # noqa: E402
from kvpool.demo.train_run import (ENGINE, TRAINER, TrainDemoConfig, kv_step_bytes,  # noqa: E402
                                   start)
from kvpool.sizes import format_size, parse_size  # noqa: E402

MODES = ("kvpool", "sleep1", "sleep2", "static")


def post(url: str, route: str) -> None:
    r = httpx.post(f"{url}{route}", timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{route}: {r.status_code} {r.text[:200]}")


class SleepSwitch:
    """Sleep levels 1 and 2 over the engine's ``/sleep`` and ``/wake_up`` (see the
    module). ``mon`` tells whether the wake reloaded the weights (no set left in the pool
    when it woke: the reload is a copy of the weights)."""

    def __init__(self, name: str, url: str, budget: int, page: int, weights: int,
                 mon: Monitor) -> None:
        self.name, self.url, self.budget, self.page = name, url, budget, page
        self.weights, self.mon = weights, mon
        self.level = 1 if name == "sleep1" else 2

    def step_bytes(self, trainer: Trainer) -> int:
        n = self.budget - trainer.held_bytes  # the engine holds nothing asleep
        return n - n % self.page

    def to_train(self) -> int:
        post(self.url, f"/sleep?level={self.level}")
        return 0

    def _wake(self) -> tuple[float, int]:
        sets = self.mon.ps().pool.weight_sets
        t0 = time.perf_counter()
        post(self.url, "/wake_up")
        return time.perf_counter() - t0, 0 if sets else self.weights

    def back(self, checkpoint: Path) -> Back:
        if self.level == 1:  # the old weights back by copy, then synced by copy
            wake_s, copied = self._wake()
            t0 = time.perf_counter()
            reply = publish(self.url, checkpoint)
            return Back(wake_s, time.perf_counter() - t0, copied + reply["bytes_copied"],
                        reply)
        t0 = time.perf_counter()  # level 2: remembered asleep, loaded by the wake
        reply = publish(self.url, checkpoint)
        pub_s = time.perf_counter() - t0
        wake_s, _ = self._wake()
        return Back(wake_s, pub_s, self.weights, reply)


def memcpy_s(nbytes: int, reps: int = 5) -> float:
    """The best of ``reps`` plain copies of ``nbytes`` (host memory, torch)."""
    if nbytes <= 0:
        return 0.0
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return best_s(lambda: dst.copy_(src), reps)


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its children (0 when gone)."""
    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    except psutil.Error:
        return 0


class Mode:
    """One mode's daemon, engine, trainer and loop."""

    def __init__(self, name: str, stack: ExitStack, work: Path, cfg: TrainDemoConfig,
                 loop_cfg: LoopConfig, static_kv: int, in_place: bool = True) -> None:
        self.name = name
        cluster = stack.enter_context(Cluster(work / name))
        kv = static_kv if name == "static" else cfg.budget
        self.url = start(cluster, cfg, kv_cache_size=kv)
        assert cluster.run_dir is not None
        self.pids = {p.name: p.popen.pid for p in cluster.procs}
        self.mon = stack.enter_context(Monitor(cluster.run_dir))
        self.trainer = stack.enter_context(connect_trainer(
            TRAINER, run_dir=cluster.run_dir, shares=cfg.trainer_shares, wait_s=120))
        self.weights = {t.name: t.weights for t in self.mon.ps().tenants}[ENGINE]
        self.held_weights = self.weights  # in place: the mutable set's two buffers
        switch: Any
        if name == "kvpool":
            switch = KvSwitch(self.url, kv_step_bytes(cfg, lambda: self.held_weights))
        elif name == "static":
            def size(trainer: Trainer) -> int:
                n = cfg.budget - self.weights - trainer.held_bytes - static_kv
                return n - n % cfg.page_size
            switch = KvSwitch(self.url, size)
        else:
            switch = SleepSwitch(name, self.url, cfg.budget, cfg.page_size, self.weights,
                                 self.mon)
        self.switch = switch
        self.loop = Loop(loop_cfg, self.url, ENGINE, cfg.model_dir, self.trainer, self.mon,
                         switch, work / name / "ckpt", in_place=name == "kvpool" and in_place)
        stack.callback(self.loop.close)  # (before the trainer's session ends)
        self.in_place = self.loop.inplace is not None
        if self.in_place:
            self.held_weights = {t.name: t.weights for t in self.mon.ps().tenants}[ENGINE]
        self.records: list[Any] = []
        self.rss: list[dict[str, int]] = []
        self.step_bytes = 0

    def cycle(self, k: int) -> None:
        self.step_bytes = self.switch.step_bytes(self.trainer)
        self.records.append(self.loop.step(k))
        self.rss.append({"engine": rss(self.pids[f"serve-{ENGINE}"]),
                         "daemon": rss(self.pids["daemon"])})


def summary(m: Mode, floor_rate: float) -> dict[str, Any]:
    recs = m.records
    med = statistics.median

    def moved_to_train(r: Any) -> int:  # the KV pages that change owner (kvpool, static)
        return max(0, r.held_rollout[ENGINE]["mapped"] - r.held_train[ENGINE]["mapped"])

    if m.name in ("kvpool", "static"):
        to_bytes = [moved_to_train(r) for r in recs]
        back_bytes = [0 for _ in recs]  # the step's pages go back; the engine regrows lazily
    elif m.name == "sleep1":
        to_bytes = [0 for _ in recs]  # (the frameworks copy the weights to host here)
        back_bytes = [r.bytes_copied - r.checkpoint_bytes - m.weights for r in recs]
    else:
        to_bytes = [0 for _ in recs]
        back_bytes = [m.weights for _ in recs]
    step = med(r.step_s for r in recs)
    to_s, back_s = med(r.to_train_s for r in recs), med(r.to_rollout_s for r in recs)
    to_floor, back_floor = med(to_bytes) / floor_rate, med(back_bytes) / floor_rate
    first, last = recs[0].held_after, recs[-1].held_after
    return {
        "cycles": len(recs), "step_s": step, "rollout_s": med(r.rollout_s for r in recs),
        "train_s": med(r.train_s for r in recs), "publish_s": med(r.publish_s for r in recs),
        "to_train_s": to_s, "to_rollout_s": back_s,
        "to_train_bytes_moved": med(to_bytes), "to_rollout_bytes_moved": med(back_bytes),
        "to_train_floor_s": to_floor, "to_rollout_floor_s": back_floor,
        "switch_share": (to_s + back_s) / step if step else 0.0,
        "bytes_copied_per_step": med(r.bytes_copied for r in recs),
        "weights_copied_per_step": med(r.weights_copied for r in recs),
        "in_place": m.in_place, "in_place_why": m.loop.in_place_why,
        "trainer_step_bytes": m.step_bytes, "engine_weights": m.weights,
        "reward_first": recs[0].reward, "reward_last": recs[-1].reward,
        "held_after_first": first, "held_after_last": last,
        "residual_growth": {n: {k: last.get(n, {}).get(k, 0) - v for k, v in h.items()}
                            for n, h in first.items()},
        "engine_rss_first": m.rss[0]["engine"], "engine_rss_last": m.rss[-1]["engine"],
        "daemon_rss_first": m.rss[0]["daemon"], "daemon_rss_last": m.rss[-1]["daemon"],
        "host_rss_peak": max(r["engine"] + r["daemon"] for r in m.rss),
        "rss_after": m.rss,  # the engine's and the daemon's resident bytes after each cycle
        "held_after": [r.held_after for r in recs],
        "steps": [{k: round(v, 5) if isinstance(v, float) else v
                   for k, v in r.as_dict().items() if not k.startswith(("held", "greedy"))}
                  for r in recs],  # (memory per cycle: held_after)
    }


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g}"


def table(results: dict[str, dict[str, Any]]) -> str:
    head = ("| mode | step s | to train ms (floor) | to rollout ms (floor) | switch share | "
            "copied/step (weights) | trainer step | reward first→last | residual growth | "
            "engine RSS first→last |")
    lines = [head, "|" + "---|" * 10]
    for name, s in results.items():
        growth = ", ".join(f"{n} {format_size(abs(v['mapped']))}" if v["mapped"] else f"{n} 0"
                           for n, v in s["residual_growth"].items())
        lines.append(
            f"| {name} | {s['step_s']:.2f} | {ms(s['to_train_s'])} ({ms(s['to_train_floor_s'])})"
            f" | {ms(s['to_rollout_s'])} ({ms(s['to_rollout_floor_s'])}) | "
            f"{100 * s['switch_share']:.1f}% | {format_size(s['bytes_copied_per_step'])} "
            f"({format_size(s['weights_copied_per_step'])}) | "
            f"{format_size(s['trainer_step_bytes'])} | {s['reward_first']:.2f}→"
            f"{s['reward_last']:.2f} | {growth} | {format_size(s['engine_rss_first'])}→"
            f"{format_size(s['engine_rss_last'])} |")
    return "\n".join(lines)


def chart(path: Path, results: dict[str, dict[str, Any]], budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(results)
    parts = [("rollout_s", "rollout"), ("to_train_s", "switch to train"),
             ("train_s", "train"), ("to_rollout_s", "switch to rollout"),
             ("publish_s", "publish")]
    bottom = [0.0] * len(names)
    for key, label in parts:
        vals = [results[n][key] for n in names]
        ax1.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("seconds per step (median)")
    ax1.set_title("where a step's time goes")
    ax1.legend(fontsize=8)
    for n in names:
        held = results[n]["held_after"]
        for tenant, style in ((ENGINE, "-"), (TRAINER, "--")):
            ax2.plot([h.get(tenant, {}).get("mapped", 0) / 2**20 for h in held], style,
                     label=f"{n} {tenant}")
    ax2.axhline(budget / 2**20, color="black", linewidth=0.8, linestyle=":")
    ax2.set_xlabel("cycle")
    ax2.set_ylabel("MiB held after the cycle (ps mapped)")
    ax2.set_title("residual memory per tenant")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--budget", default="16MiB")
    ap.add_argument("--static-kv", default="512KiB")
    ap.add_argument("--out", default=None)
    ap.add_argument("--kvpool-copy", action="store_true",
                    help="kvpool mode publishes by checkpoint (a copy), not in place")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or args.cycles < 1:
        print(f"train_colocate_bench: --modes from {','.join(MODES)}, --cycles >= 1",
              file=sys.stderr)
        return 2
    try:
        budget, static_kv = parse_size(args.budget), parse_size(args.static_kv)
    except ValueError as e:
        print(f"train_colocate_bench: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="train-colocate-"))
    cfg = TrainDemoConfig(out_dir=work, budget=budget)
    loop_cfg = LoopConfig(steps=args.cycles, prompts=4, samples=4, prompt_len=64,
                          max_tokens=8, greedy_check=False)
    t0 = time.monotonic()
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)  # checkpoints and logs: gone at the end
        runs = [Mode(m, stack, work, cfg, loop_cfg, static_kv, not args.kvpool_copy)
                for m in modes]
        for k in range(args.cycles):  # interleaved: cycle k of every mode, then k + 1
            for m in runs:
                m.cycle(k)
            print(f"cycle {k + 1}/{args.cycles}: " + "  ".join(
                f"{m.name} {m.records[-1].step_s:.2f}s" for m in runs), flush=True)
        problems = {m.name: m.mon.check() for m in runs}
    weights = runs[0].weights
    floor_rate = weights / memcpy_s(weights)  # bytes per second of a plain copy
    results = {m.name: summary(m, floor_rate) for m in runs}
    text = table(results)
    print(text)
    out = Path(args.out) if args.out else RESULTS / "train_colocate.json"
    write_result("train_colocate", {
        "budget": budget, "static_kv": static_kv, "loop": asdict(loop_cfg),
        "memcpy_bytes_per_s": floor_rate, "memcpy_weights_s": weights / floor_rate,
        "bench_rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": time.monotonic() - t0, "check": problems, "table": text,
        "modes": results}, str(out))
    chart(out.with_suffix(".png"), results, budget)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if not any(problems.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
