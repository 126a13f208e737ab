"""Weights published in place (issue 37 item 3; docs/ARCHITECTURE.md, "Mutable weight
sets"): a real daemon, a real elastic ``kvpool serve`` of the tiny model with its weights
in the pool, the trainer as this process (the loop) or a child (killed mid-publish). The
policy's parameters are the engine's weights, a mutable set the trainer writes: after
every publish the engine's greedy tokens equal a fresh engine's loaded from the trainer's
checkpoint, no byte of weights is copied, the engine never reads a half-written version,
and a trainer killed mid-publish leaves the engine on the last complete one with nothing
leaked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import torch

from kvpool.client_lib import Monitor
from kvpool.client_lib.trainer import connect_trainer
from kvpool.demo.cluster import Cluster
from kvpool.demo.policy import Policy
from kvpool.demo.rl_loop import KvSwitch, Loop, LoopConfig, publish_mutable
from kvpool.demo.train_run import (ENGINE, TRAINER, TrainDemoConfig, engine_weights,
                                   kv_step_bytes, start)
from kvpool.engine_adapters.bundled.inplace_trainer import InPlaceWeights, placement

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("inplace_worker.py")
STEPS = 3
PROMPTS = [[9 + i, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50] for i in range(3)]


def fresh_greedy(cluster: Cluster, checkpoint: Path, name: str,
                 prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The greedy answers of a new static server loaded from ``checkpoint``."""
    proc = cluster.serve(name, checkpoint, 4 << 20, elastic=False,
                         extra=("--device", "cpu", "--max-model-len", "512"))
    cluster.wait_healthy(180)
    assert proc.url is not None
    return Loop.greedy_of(proc.url, name, prompts, max_tokens)


def save(loop: Loop, step: int, tmp_path: Path) -> Path:
    """The trainer's weights now as a checkpoint (the test's, not the loop's: in place
    the loop writes none)."""
    path = tmp_path / f"trainer-step{step}"
    loop.policy.save(path, loop.source)
    return path


def sets(mon: Monitor) -> dict[str, list[str]]:
    return {t.name: t.weight_sets for t in mon.ps().tenants}


def test_loop_publishes_in_place_and_copies_no_weights(tmp_path):
    cfg = TrainDemoConfig(out_dir=tmp_path)
    with Cluster(tmp_path / "logs") as cluster:
        url = start(cluster, cfg)
        assert cluster.run_dir is not None
        with Monitor(cluster.run_dir) as mon, \
                connect_trainer(TRAINER, run_dir=cluster.run_dir,
                                shares=cfg.trainer_shares, wait_s=60) as tr:
            sealed = engine_weights(mon)
            held = {"weights": sealed}
            saved: list[Path] = []
            loop = Loop(LoopConfig(steps=STEPS), url, ENGINE, cfg.model_dir, tr, mon,
                        KvSwitch(url, kv_step_bytes(cfg, lambda: held["weights"])),
                        tmp_path / "ckpt", in_place=True,
                        on_step=lambda r: saved.append(save(loop, r.step, tmp_path)))
            assert loop.inplace is not None, loop.in_place_why
            key = loop.inplace.key
            # the engine reads the trainer's set: both hold it, two buffers of its layout
            assert sets(mon)[ENGINE] == sets(mon)[TRAINER] == [key[:12]]
            held["weights"] = engine_weights(mon)
            assert held["weights"] == 2 * sealed
            before = loop.greedy()
            assert before == fresh_greedy(cluster, cfg.model_dir, "fresh-source",
                                          loop.prompts, loop.cfg.max_tokens)
            records = loop.run()
            for r in records:
                assert r.weights_copied == 0 and r.checkpoint_bytes == 0
                assert r.held_train[ENGINE]["weights"] == held["weights"]  # the same set
            assert loop.version == STEPS + 1
            assert records[-1].greedy != before  # the publishes took effect
            for r, ckpt in zip(records, saved):  # each exactly the trainer's weights
                assert fresh_greedy(cluster, ckpt, f"fresh{r.step}", loop.prompts,
                                    loop.cfg.max_tokens) == r.greedy, r.step
            assert mon.check() == []
            loop.close()  # the writer lets go: the engine keeps the last version
            assert loop.greedy() == records[-1].greedy
            assert sets(mon)[TRAINER] == [] and sets(mon)[ENGINE] == [key[:12]]
            assert mon.check() == []


def test_engine_reading_during_a_write_sees_the_complete_version(tmp_path):
    cfg = TrainDemoConfig(out_dir=tmp_path)
    with Cluster(tmp_path / "logs") as cluster:
        url = start(cluster, cfg)
        assert cluster.run_dir is not None
        with Monitor(cluster.run_dir) as mon, \
                connect_trainer(TRAINER, run_dir=cluster.run_dir) as tr:
            policy = Policy.load(cfg.model_dir)
            placed = placement(cfg.model_dir, torch.float32,
                               {n: policy.w(n) for n in policy.names})
            assert not isinstance(placed, str), placed
            w = InPlaceWeights.create(tr.tenant, placed, {
                n: policy.params[i] for i, n in enumerate(policy.names)})
            assert publish_mutable(url, w.nonce)["version"] == 1
            v1 = Loop.greedy_of(url, ENGINE, PROMPTS, 8)
            b = w.writer.begin_write()  # the back buffer, written under the engine
            for view in w.views[b].values():
                view.fill_(1e3)
            assert Loop.greedy_of(url, ENGINE, PROMPTS, 8) == v1  # reads version 1 only
            r = httpx.post(f"{url}/kvpool/weights", json={"mutable": w.nonce, "version": 2},
                           timeout=60)  # not published: the engine cannot read it
            assert r.status_code == 400 and "not the current" in r.json()["error"]["message"]
            assert Loop.greedy_of(url, ENGINE, PROMPTS, 8) == v1
            for view in w.views[b].values():  # a complete version: zeros
                view.zero_()
            assert w.writer.publish() == 2
            assert publish_mutable(url, w.nonce, 2)["version"] == 2
            v2 = Loop.greedy_of(url, ENGINE, PROMPTS, 8)
            assert v2 != v1 and len(set(map(tuple, v2))) == 1  # zero weights: one answer
            assert mon.check() == []
            w.close()


def test_trainer_killed_mid_publish_leaves_the_last_version(tmp_path):
    cfg = TrainDemoConfig(out_dir=tmp_path)
    with Cluster(tmp_path / "logs") as cluster:
        url = start(cluster, cfg)
        assert cluster.run_dir is not None
        sealed_v1 = Loop.greedy_of(url, ENGINE, PROMPTS, 8)
        proc = subprocess.Popen([sys.executable, str(WORKER), str(cfg.model_dir), url,
                                 "--run-dir", str(cluster.run_dir)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            ev = json.loads(line)
            assert ev["event"] == "writing" and ev["version"] == 1
            with Monitor(cluster.run_dir) as mon:
                key = sets(mon)[ENGINE][0]
                assert sets(mon)[TRAINER] == [key]
                assert Loop.greedy_of(url, ENGINE, PROMPTS, 8) == sealed_v1  # mid-write
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                assert TRAINER not in sets(mon) or sets(mon)[TRAINER] == []
                assert Loop.greedy_of(url, ENGINE, PROMPTS, 8) == sealed_v1  # version 1
                assert mon.check() == []
                r = httpx.post(f"{url}/kvpool/weights",
                               json={"mutable": ev["nonce"], "version": 2}, timeout=60)
                assert r.status_code == 400  # the half-written version never exists
                # the engine lets go (sleep): nobody holds the set, it goes, pages back
                r = httpx.post(f"{url}/sleep", params={"level": 1}, timeout=120)
                assert r.status_code == 200, r.text
                pool = mon.ps().pool
                assert pool is not None and key not in str(sets(mon))
                assert mon.check() == []
                r = httpx.post(f"{url}/wake_up", timeout=120)  # back to its checkpoint
                assert r.status_code == 200, r.text
                assert Loop.greedy_of(url, ENGINE, PROMPTS, 8) == sealed_v1
                assert sets(mon)[ENGINE] != [key] and mon.check() == []
        finally:
            proc.kill()
            proc.wait(timeout=30)


def test_in_place_refusals_are_one_line(tmp_path):
    cfg = TrainDemoConfig(out_dir=tmp_path)
    with Cluster(tmp_path / "logs") as cluster:
        url = start(cluster, cfg)
        for body in ({"mutable": "ab" * 16, "checkpoint": "/tmp"}, {"mutable": "xyz"},
                     {"mutable": "AB" * 16}, {"mutable": "ab" * 40}, {"version": 2},
                     {"mutable": "ab" * 16, "version": 0}, {"mutable": 5},
                     {"mutable": "ab" * 16, "version": "two"}):
            r = httpx.post(f"{url}/kvpool/weights", json=body, timeout=60)
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert "\n" not in r.json()["error"]["message"]
        # a nonce of no set of this engine's layout (a trainer of another layout)
        r = httpx.post(f"{url}/kvpool/weights", json={"mutable": "ab" * 16}, timeout=60)
        assert r.status_code == 400 and "layout" in r.json()["error"]["message"]
        policy = Policy.load(cfg.model_dir)
        why = placement(cfg.model_dir, torch.bfloat16, {n: policy.w(n) for n in policy.names})
        assert isinstance(why, str) and "bfloat16" in why  # another dtype: no in place
        assert Loop.greedy_of(url, ENGINE, PROMPTS, 4)  # serving on
        assert cluster.run_dir is not None
        with Monitor(cluster.run_dir) as mon:
            assert mon.check() == []
