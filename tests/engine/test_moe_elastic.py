"""Elastic KV for a Mixture-of-Experts model: the bundled engine's kvpool-backed pool runs
a tiny Qwen2-MoE (routed + shared experts) with the same greedy tokens as the static
engine, also when its small share forces preemption. MoE replaces the MLP only, so
nothing in the pool or the adapter knows about it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture: a real daemon)
from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine_adapters.bundled import BundledElasticPool, Settings, enable

PROMPTS = [[random.Random(i).randrange(8, 512) for _ in range(random.Random(-i).randrange(5, 60))]
           for i in range(6)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.engine.model.tiny import make_tiny_model

    # hidden 128 / 4 heads / 2 KV heads / 2 layers: 16 KiB KV blocks, as the bundled tests
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-qwen2-moe", arch="qwen2_moe",
                           layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, seed=0,
                           num_experts=8, experts_per_token=2)


def run(engine: Engine) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, str(i))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
        engine.check_integrity()
    return outs


def test_elastic_moe_equals_static(moe_model, start_daemon):  # noqa: F811
    reference = run(Engine(EngineConfig(model=str(moe_model), kv_cache_size="8MiB")))
    d = start_daemon(budget="8MiB")
    cfg = EngineConfig(model=str(moe_model), kv_cache_size="128KiB")  # 8 blocks of 16 KiB
    bridge = enable(cfg, Settings(run_dir=str(d.run_dir), name="moe", idle_timeout_s=1.0))
    e = Engine(bridge.config, bridge.seams)
    assert isinstance(e.pool, BundledElasticPool)
    assert run(e) == reference
    assert e.scheduler.num_preemptions > 0
    assert [t["name"] for t in d.cli_json("ps")["tenants"]] == ["moe"]
    assert not d.check()
