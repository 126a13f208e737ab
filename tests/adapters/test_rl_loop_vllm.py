"""The RL loop with vLLM as the rollout engine (issue 37 item 4; :mod:`kvpool.demo.rl_loop`):
a real daemon, a real vLLM CPU server as a kvpool tenant (``KVPOOL_ENABLE``), this
process as the trainer tenant. The loop is the bundled engine's, unchanged: the trainer's
step makes the daemon take vLLM's KV; each update is published through vLLM's own
weight-update path (``POST /kvpool/weights`` on vLLM's API server: pause at a step
boundary, ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` with
kvpool's transfer engine, prefix cache reset). After the publishes vLLM's greedy tokens
are a fresh vLLM's loaded from the trainer's checkpoint; bad publishes are one-line 400s
that change nothing."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from kvpool.client_lib import Monitor
from kvpool.client_lib.trainer import connect_trainer
from kvpool.demo.rl_loop import KvSwitch, Loop, LoopConfig
from kvpool.demo.train_run import TRAINER, TrainDemoConfig, ensure_model

from .vllm_procs import VllmServers, remove_daemon, start_daemon, vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (CPU build) not installed")

STEPS = 3
KEEP = 256 << 10  # the KV vLLM keeps while the trainer steps: one allocation unit here


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("rl-vllm")
    cfg = TrainDemoConfig(out_dir=d)
    model = ensure_model(cfg)
    daemon = start_daemon(budget="16MiB", page_size=64 << 10)
    servers = VllmServers(model, d)
    try:
        vl = servers.start("vl", daemon.run_dir)
        servers.wait_healthy(vl)
        yield cfg, model, daemon, servers, vl
    finally:
        servers.close()
        remove_daemon(daemon)


def publish(base: str, body: object) -> httpx.Response:
    return httpx.post(f"{base}/kvpool/weights", content=json.dumps(body), timeout=300,
                      headers={"Content-Type": "application/json"})


def test_loop_on_vllm_publishes_through_vllms_weight_update(setup, tmp_path):
    cfg, model, daemon, servers, vl = setup
    with Monitor(daemon.run_dir) as mon, \
            connect_trainer(TRAINER, run_dir=daemon.run_dir, shares=cfg.trainer_shares,
                            wait_s=60) as tr:
        def step_bytes(trainer) -> int:
            n = cfg.budget - trainer.held_bytes - KEEP
            return int(n - n % cfg.page_size)

        loop = Loop(LoopConfig(steps=STEPS), vl.base, "vl", model, tr, mon,
                    KvSwitch(vl.base, step_bytes), tmp_path / "ckpt")
        before = loop.greedy()
        records = loop.run()
        assert mon.check() == []
        for r in records:
            # the trainer's step took vLLM's KV down to the keep (its weights are its own,
            # never the pool's; what the rollout left depends on how many requests ran
            # at once, so the bound is the outcome)
            assert r.held_train["vl"]["mapped"] <= min(r.held_rollout["vl"]["mapped"], KEEP)
            # one copy into vLLM's parameters besides the checkpoint written
            assert r.bytes_copied == 2 * r.checkpoint_bytes
        assert records[-1].greedy != before
        fresh_model = tmp_path / "fresh-model"
        shutil.copytree(loop.checkpoints[-1], fresh_model)
        assert mon.check() == []
    # a vLLM of its own (no kvpool) loaded from the last checkpoint answers the same
    fresh_servers = VllmServers(fresh_model, tmp_path)
    try:
        fresh = fresh_servers.start("vl", None)
        fresh_servers.wait_healthy(fresh)
        assert Loop.greedy_of(fresh.base, "vl", loop.prompts, loop.cfg.max_tokens) == \
            records[-1].greedy
    finally:
        fresh_servers.close()


def test_bad_publishes_are_one_line_and_change_nothing(setup, tmp_path):
    cfg, model, daemon, servers, vl = setup
    prompts = [[9, 10, 11, 12, 13, 14, 15, 16]]
    before = Loop.greedy_of(vl.base, "vl", prompts, 8)
    other = tmp_path / "other"
    from kvpool.engine.model.tiny import make_tiny_model

    make_tiny_model(other, layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(model / "config.json", empty / "config.json")
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"\xff" * 64)
    cases = [({"checkpoint": str(tmp_path / "missing")}, "is not a folder"),
             ({"checkpoint": "x" * 5000}, "at most 4096"),
             ({"checkpoint": 7}, "folder path"),
             ({"path": str(model)}, "the body must be"),
             ({"checkpoint": str(other)}, "hidden_size"),
             ({"checkpoint": str(empty)}, "no .safetensors"),
             ({"checkpoint": str(broken)}, "not a safetensors file")]
    for body, says in cases:
        r = publish(vl.base, body)
        assert r.status_code == 400, (body, r.text)
        message = r.json()["error"]["message"]
        assert says in message and "\n" not in message, message
    r = httpx.post(f"{vl.base}/kvpool/weights", content=b"{nope", timeout=60)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    assert Loop.greedy_of(vl.base, "vl", prompts, 8) == before
    assert servers.all[0].proc.poll() is None
