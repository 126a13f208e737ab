"""The elastic bundled engine against a real daemon: same tokens as the static engine
(also under preemption and across reclaim), and the adapter's refusals."""

from __future__ import annotations

import random
import threading

import pytest

from kvpool.client_lib import connect
from kvpool.client_lib.errors import DaemonUnavailable
from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine_adapters.bundled import (
    AdapterError,
    BundledElasticPool,
    Settings,
    check_engine,
    enable,
)

PROMPTS = [
    [random.Random(i).randrange(8, 512) for _ in range(random.Random(-i).randrange(5, 90))]
    for i in range(14)
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(engine: Engine, during=None, params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, str(i))
    outs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
        steps += 1
        if during:
            during(steps)
        engine.check_integrity()
    return outs


def elastic(model, daemon, name: str, weights: str = "pool", **kw) -> Engine:
    cfg = EngineConfig(model=str(model), **kw)
    bridge = enable(cfg, Settings(run_dir=str(daemon.run_dir), name=name, idle_timeout_s=1.0,
                                  weights=weights))
    return Engine(bridge.config, bridge.seams)


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[str, list[int]]:
    return run(Engine(EngineConfig(model=str(tiny_model), kv_cache_size="8MiB")))


def test_elastic_equals_static(tiny_model, start_daemon, reference):
    d = start_daemon(budget="8MiB")
    e = elastic(tiny_model, d, "eq", kv_cache_size="8MiB")
    assert isinstance(e.pool, BundledElasticPool)
    assert run(e) == reference
    held = d.cli_json("ps")
    assert [t["name"] for t in held["tenants"]] == ["eq"]
    assert not d.check()


def test_elastic_equals_static_under_preemption(tiny_model, start_daemon, reference):
    d = start_daemon(budget="8MiB")
    e = elastic(tiny_model, d, "small", kv_cache_size="320KiB")  # 20 blocks of 16 KiB
    assert run(e) == reference
    assert e.scheduler.num_preemptions > 0


def test_elastic_equals_static_across_reclaim(tiny_model, start_daemon):
    """A lease of half the budget arrives while the engine holds most of it: the engine
    shrinks (evicting its prefix cache, preempting when it must) and, after the lease
    ends, grows back and finishes with the same tokens as the static engine."""
    long = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    reference = run(Engine(EngineConfig(model=str(tiny_model), kv_cache_size="8MiB")),
                    params=long)
    d = start_daemon(budget="2MiB", extra=("--reclaim-timeout", "60"))  # generous
    # the whole 2 MiB budget is for KV here (the weights would take most of it)
    e = elastic(tiny_model, d, "victim", weights="local", kv_cache_size="2MiB")
    other = connect(name="trainer", run_dir=d.run_dir, kind="lease")
    lease: dict = {}
    granted = threading.Event()

    def take_lease():
        lease["obj"] = other.lease(1 << 20)
        lease["mapped_then"] = e.pool.allocator.holdings().mapped
        granted.set()

    thread = threading.Thread(target=take_lease)

    def during(step: int) -> None:
        if "started" not in lease and e.pool.allocator.holdings().mapped >= 1280 << 10:
            lease["started"] = step
            thread.start()
            # between two steps the engine's shrink runs (it takes the step lock): wait
            # here for the grant, so it comes while requests run however busy the
            # machine is (no step races it)
            assert granted.wait(120), "the lease was not granted while the engine ran"
            lease["granted"] = step
        if "granted" in lease and step == lease["granted"] + 50:
            lease["obj"].close()

    try:
        assert run(e, during, long) == reference
        assert "started" in lease, "the engine never held enough to be squeezed"
        thread.join(10)
        assert "granted" in lease, "the lease was not granted while the engine ran"
        assert lease["mapped_then"] <= 1 << 20  # the engine gave back what the lease took
        assert e.pool.policy.shrinks > 0
        assert e.pool.policy.shrink_preemptions + e.scheduler.num_preemptions > 0
    finally:
        other.close()


def test_refuses_unknown_engine_or_layout(tiny_model, monkeypatch):
    cfg = EngineConfig(model=str(tiny_model))
    object.__setattr__(cfg, "kv_layout", "interleaved")  # past the config's own check
    with pytest.raises(AdapterError, match="layout"):
        check_engine(cfg)
    from kvpool.engine import block_pool

    monkeypatch.setattr(block_pool.BlockPool, "__abstractmethods__",
                        frozenset({"get_new_blocks", "allocate_v2"}))
    with pytest.raises(AdapterError, match="engine version"):
        check_engine(EngineConfig(model=str(tiny_model)))


def test_refuses_without_a_daemon(tiny_model, tmp_path):
    cfg = EngineConfig(model=str(tiny_model))
    bridge = enable(cfg, Settings(run_dir=str(tmp_path / "nowhere"), name="x"))
    with pytest.raises(DaemonUnavailable, match="no kvpool daemon at .*nowhere"):
        Engine(bridge.config, bridge.seams)


def test_kvpool_enable_makes_an_unmodified_launch_elastic(tiny_model, tmp_path):
    """``KVPOOL_ENABLE=1`` with a plain ``kvpool serve`` (no --elastic) joins the daemon."""
    import httpx

    from kvpool.client_lib import Monitor
    from kvpool.demo.cluster import Cluster

    with Cluster(tmp_path / "logs") as c:
        c.daemon(4 << 20, 64 << 10)
        s = c.serve("plain", tiny_model, 4 << 20, elastic=False,
                    env={"KVPOOL_ENABLE": "1", "KVPOOL_RUN_DIR": str(c.run_dir)})
        c.wait_healthy()
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"prompt": [11, 12, 13], "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200
        with Monitor(c.run_dir) as m:
            (tenant,) = m.ps().tenants
        assert tenant.name == "plain" and tenant.kind == "engine" and tenant.mapped > 0
