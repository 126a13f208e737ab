"""``engine.close()`` of an elastic bundled engine: the daemon forgets the tenant, its
pages go back to the pool and the adapter's threads end (before, every in-process
elastic engine kept all of them until the process exited). Its weight set stays cached."""

from __future__ import annotations

import threading

from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine_adapters.bundled import Settings, bridge_of, enable


def test_close_ends_the_tenant_its_pages_and_its_threads(tiny_model, start_daemon):
    d = start_daemon(budget="8MiB")
    before = set(threading.enumerate())
    cfg = EngineConfig(model=str(tiny_model), kv_cache_size="2MiB")
    bridge = enable(cfg, Settings(run_dir=str(d.run_dir), name="closing", idle_timeout_s=1.0))
    e = Engine(bridge.config, bridge.seams)
    e.add_request([11, 12, 13], SamplingParams(max_tokens=4, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    assert [t["name"] for t in d.cli_json("ps")["tenants"]] == ["closing"]
    assert d.stats().pool.granted > 0
    started = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    names = sorted(t.name for t in started)
    assert any(n.startswith("kvpool-refill-") for n in names), names
    assert "kvpool-idle-cache" in names and "kvpool-tenant-closing" in names, names

    e.close()

    for t in started:
        t.join(10)
    assert [t.name for t in started if t.is_alive()] == []
    assert d.cli_json("ps")["tenants"] == []
    pool = d.stats().pool
    assert pool.granted == pool.weights_cached > 0  # only the weight set, cached
    assert not d.check()
    assert bridge_of(e).tenant is None
    e.close()  # a second close changes nothing

