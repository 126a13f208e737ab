"""A reinforcement-learning loop that learns on one budget (issue 37 item 4;
:mod:`kvpool.demo.rl_loop`): a real daemon, a real elastic ``kvpool serve`` of the tiny
model with its weights in the pool, this process as the trainer tenant. A few GRPO steps:
the reward rises; after each publish the engine's greedy tokens are a fresh engine's
loaded from the trainer's checkpoint; the trainer's step takes the engine's KV, never its
weights; ``kvpool check`` is clean."""

from __future__ import annotations

import httpx

from kvpool.client_lib import Monitor
from kvpool.client_lib.trainer import connect_trainer
from kvpool.demo.cluster import Cluster
from kvpool.demo.rl_loop import KvSwitch, Loop, LoopConfig
from kvpool.demo.train_run import ENGINE, TRAINER, TrainDemoConfig, kv_step_bytes, start

STEPS = 6


def fresh_greedy(cluster: Cluster, loop: Loop, checkpoint, name: str) -> list[list[int]]:
    """The greedy answers of a new static server loaded from ``checkpoint``."""
    proc = cluster.serve(name, checkpoint, 4 << 20, elastic=False,
                         extra=("--device", "cpu", "--max-model-len", "512"))
    cluster.wait_healthy(180)
    assert proc.url is not None
    return Loop.greedy_of(proc.url, name, loop.prompts, loop.cfg.max_tokens)


def test_loop_learns_publishes_and_switches_kv_not_weights(tmp_path):
    cfg = TrainDemoConfig(out_dir=tmp_path)
    with Cluster(tmp_path / "logs") as cluster:
        url = start(cluster, cfg)
        assert cluster.run_dir is not None
        with Monitor(cluster.run_dir) as mon, \
                connect_trainer(TRAINER, run_dir=cluster.run_dir,
                                shares=cfg.trainer_shares, wait_s=60) as tr:
            weights = {t.name: t.weights for t in mon.ps().tenants}[ENGINE]
            assert weights > 0
            loop = Loop(LoopConfig(steps=STEPS), url, ENGINE, cfg.model_dir, tr, mon,
                        KvSwitch(url, kv_step_bytes(cfg, weights)), tmp_path / "ckpt")
            before = loop.greedy()
            records = loop.run()
            assert mon.check() == []
            # the switch took KV, never the weights; every step held what the first did
            for r in records:
                eng, during = r.held_rollout[ENGINE], r.held_train[ENGINE]
                assert eng["weights"] == during["weights"] == weights
                # (what the rollout left mapped depends on how many of its requests ran
                # at once: on a fast machine it can stay within the keep, so the step
                # has nothing to take; the switch's outcome is the bound)
                assert during["mapped"] <= min(eng["mapped"], cfg.engine_keep)
                assert r.held_train[TRAINER] == records[0].held_train[TRAINER]
                assert r.bytes_copied == 2 * r.checkpoint_bytes  # written, loaded once
            # it learned: the last steps' reward above the first steps'
            rewards = [r.reward for r in records]
            assert sum(rewards[-2:]) > sum(rewards[:2]), rewards
            # the publishes took effect, and each is exactly the checkpoint's weights
            assert records[-1].greedy != before
            for r, ckpt in zip(records[-2:], loop.checkpoints):
                assert fresh_greedy(cluster, loop, ckpt, f"fresh{r.step}") == r.greedy
        with Monitor(cluster.run_dir) as mon:
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert mon.check() == []


def test_publish_drops_the_stale_prefix_cache(tmp_path):
    """Prompts cached under the old weights, then a publish with no trainer step between
    (nothing took the cache): the engine answers as a fresh engine of the new checkpoint."""
    import torch

    from kvpool.demo.policy import Policy

    cfg = TrainDemoConfig(out_dir=tmp_path)
    with Cluster(tmp_path / "logs") as cluster:
        url = start(cluster, cfg)
        prompts = [[9 + i, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]
                   for i in range(3)]
        before = Loop.greedy_of(url, ENGINE, prompts, 8)  # their prefix blocks now cached
        policy = Policy.load(cfg.model_dir)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ckpt = tmp_path / "perturbed"
        policy.save(ckpt, cfg.model_dir)
        r = httpx.post(f"{url}/kvpool/weights", json={"checkpoint": str(ckpt)}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["loaded"] and r.json()["bytes_copied"] == r.json()["bytes"] > 0
        after = Loop.greedy_of(url, ENGINE, prompts, 8)
        proc = cluster.serve("fresh", ckpt, 4 << 20, elastic=False,
                             extra=("--device", "cpu", "--max-model-len", "512"))
        cluster.wait_healthy(180)
        assert proc.url is not None
        assert after == Loop.greedy_of(proc.url, "fresh", prompts, 8) != before
        assert cluster.run_dir is not None
        with Monitor(cluster.run_dir) as mon:
            assert mon.check() == []


def test_publish_refusals_are_one_line(tmp_path):
    cfg = TrainDemoConfig(out_dir=tmp_path)
    with Cluster(tmp_path / "logs") as cluster:
        url = start(cluster, cfg)
        r = httpx.post(f"{url}/kvpool/weights", json={"checkpoint": str(tmp_path / "none")})
        assert r.status_code == 400 and "no checkpoint folder" in r.json()["error"]["message"]
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "config.json").write_text((cfg.model_dir / "config.json").read_text())
        r = httpx.post(f"{url}/kvpool/weights", json={"checkpoint": str(bad)})
        assert r.status_code == 400, r.text
        r = httpx.post(f"{url}/kvpool/weights", json={})
        assert r.status_code == 400  # (the server answers a malformed body 400)
        for hostile in ("a\x00b", "x" * 5000, "/" + "y/" * 3000):  # no 500, no traceback
            r = httpx.post(f"{url}/kvpool/weights", json={"checkpoint": hostile})
            assert r.status_code == 400, (hostile[:20], r.status_code, r.text)
            assert "\n" not in r.json()["error"]["message"]
        # the engine serves on with its weights
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4},
                        timeout=60)
        assert ok.status_code == 200
        assert cluster.run_dir is not None
        with Monitor(cluster.run_dir) as mon:
            assert mon.check() == []


def test_train_scenario_bad_options_are_one_line_exit_2(tmp_path):
    from click.testing import CliRunner

    from kvpool.cli.main import cli

    out = str(tmp_path / "out")
    for args, says in ((["--scenario", "train", "--engine", "vllm"], "--engine"),
                       (["--scenario", "train", "--budget", "lots"], "lots"),
                       (["--scenario", "train", "--steps", "0"], "--steps"),
                       (["--scenario", "kv", "--steps", "3"], "--steps")):
        r = CliRunner().invoke(cli, ["demo", "--out", out, *args])
        assert r.exit_code == 2, (args, r.output)
        assert says in r.output.splitlines()[-1] and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()  # refused before anything ran
    r = CliRunner().invoke(cli, ["demo", "--out", out, "--scenario", "train", "--model",
                                 str(tmp_path / "nowhere")])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "--model" in r.output.splitlines()[-1] and "no such checkpoint" in r.output
    assert not (tmp_path / "out").exists()


def test_train_scenario_trains_the_model_given(tmp_path):
    """``kvpool demo --scenario train --model DIR``: the loop trains that checkpoint (here
    a tiny one of the demo's shape, so it runs in CI; SmolLM2 with ``--model smollm2``)."""
    import json
    import subprocess
    import sys

    from kvpool.engine.model.tiny import make_tiny_model

    model = tmp_path / "policy-ckpt"
    make_tiny_model(model, layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, seed=3)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "demo", "--scenario", "train",
                        "--model", str(model), "--budget", "16MiB", "--page-size", "64KiB",
                        "--steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "train_results.json").read_text())
    assert doc["model"] == str(model) and doc["in_place"] and doc["check"] == []
    assert len(doc["steps"]) == 2 and doc["loop"]["lr"] == 5e-5
    assert not (out / "models" / "policy").exists()  # no tiny model was made instead


def test_a_budget_without_room_for_the_step_is_one_line():
    """The step's size is what the budget leaves beside the engine's weights, the
    trainer's state and the engine's keep; none left is a one-line error (the CLI's
    ``demo failed: ...``), never a negative step."""
    from types import SimpleNamespace

    import pytest

    cfg = TrainDemoConfig(budget=4 << 20, page_size=64 << 10, engine_keep=256 << 10)
    size = kv_step_bytes(cfg, 3 << 20)
    assert size(SimpleNamespace(held_bytes=512 << 10)) == 256 << 10
    with pytest.raises(RuntimeError, match="^the budget .* give a larger --budget$"):
        size(SimpleNamespace(held_bytes=1 << 20))
