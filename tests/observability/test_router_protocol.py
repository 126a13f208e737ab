"""The model-server protocol a cluster router (the Gateway API Inference Extension's
endpoint picker, llm-d's router) reads from ``GET /metrics``, checked on a real elastic
``kvpool serve`` over a real daemon: every name of :data:`PROTOCOL` with its type, every
value finite and non-negative (awake, under pressure, asleep), and the meanings of the
elastic ones: KV use over blocks held plus blocks the daemon would grant at once (not
over the virtual maximum), ``cache_config_info``'s blocks that same denominator, a
sleeping server saying so."""

from __future__ import annotations

import math
import urllib.request

import httpx
from prometheus_client.parser import text_string_to_metric_families

from daemon.helpers import wait_for
from engine.conftest import tiny_dir  # noqa: F401  (the tiny model fixture)
from kvpool.client_lib import connect
from kvpool.engine.serving.metrics import EngineMetrics, MemoryView, finite, kv_usage


NAME = "m1"
#: the router's names (vLLM's, engine type ``vllm``) and the ``kvpool`` engine type's
#: extra scalars: name -> (type, meaning)
PROTOCOL = {
    "vllm:num_requests_waiting": ("gauge", "requests queued, not yet running"),
    "vllm:num_requests_running": ("gauge", "requests running"),
    "vllm:kv_cache_usage_perc": ("gauge", "blocks used / (held + grantable at once), 0..1"),
    "vllm:cache_config_info": ("gauge", "1; labels block_size, num_gpu_blocks = held + "
                                        "grantable"),
    "kvpool:asleep": ("gauge", "1 while the model sleeps"),
    "kvpool:kv_blocks_held": ("gauge", "usable blocks mapped now"),
    "kvpool:kv_blocks_grantable": ("gauge", "blocks the daemon would grant at once"),
    "kvpool:headroom_bytes": ("gauge", "the daemon's Room.headroom"),
    "kvpool:granted_bytes": ("gauge", "bytes the tenant holds"),
    "kvpool:min_bytes": ("gauge", "the tenant's min"),
    "kvpool:max_bytes": ("gauge", "the tenant's max"),
    "kvpool:pool_free_bytes": ("gauge", "the pool's free bytes"),
}


def read(port: int) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """(family name -> type, {(sample name, sorted labels): value}) of one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    types, out = {}, {}
    for fam in text_string_to_metric_families(text.decode()):
        types[fam.name] = fam.type
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, out


def one(m: dict, name: str, **labels) -> float:
    got = [v for (n, ls), v in m.items()
           if n == name and all(dict(ls).get(k) == str(x) for k, x in labels.items())]
    assert len(got) == 1, (name, got)
    return got[0]


def config_blocks(m: dict) -> int:
    (labels,) = [dict(ls) for (n, ls) in m if n == "vllm:cache_config_info"]
    assert labels["model_name"] == NAME
    return int(labels["num_gpu_blocks"])


def check_protocol(types: dict, m: dict) -> None:
    """Every name with its type, every value finite and non-negative, the usage in 0..1
    and equal to used / (held + grantable), num_gpu_blocks that denominator."""
    for name, (kind, meaning) in PROTOCOL.items():
        assert types.get(name) == kind, (name, meaning, types.get(name))
    for key, v in m.items():
        assert math.isfinite(v) and v >= 0, (key, v)
    held = one(m, "kvpool:kv_blocks_held", model_name=NAME)
    grantable = one(m, "kvpool:kv_blocks_grantable", model_name=NAME)
    used = one(m, "kvpool_engine_kv_blocks", model_name=NAME, state="used")
    usage = one(m, "vllm:kv_cache_usage_perc", model_name=NAME)
    assert 0 <= usage <= 1
    assert usage == (used / (held + grantable) if held + grantable else 0.0)
    assert config_blocks(m) == held + grantable
    assert one(m, "vllm:cache_config_info", model_name=NAME) == 1
    assert one(m, "kvpool:headroom_bytes", model_name=NAME) <= \
        one(m, "kvpool:pool_free_bytes", model_name=NAME)


def test_values_stay_finite_at_the_edges() -> None:
    assert kv_usage(0, 0, 0) == 0.0  # nothing held, nothing grantable (asleep, no room)
    assert kv_usage(5, 4, 0) == 1.0  # (a race between two reads) never above 1
    assert kv_usage(3, 2, 4) == 0.5
    for bad in (math.nan, math.inf, -math.inf, -1.0):
        assert finite(bad) == 0.0
    assert MemoryView(held=0, grantable=0).scalars == {}


def test_a_failing_memory_source_leaves_the_static_meaning(tiny_dir) -> None:  # noqa: F811
    from kvpool.engine import LLM
    from kvpool.engine.serving.async_engine import AsyncEngine

    class Gone:
        def memory_view(self) -> MemoryView | None:
            raise RuntimeError("the adapter's tenant is closed")

    llm = LLM(str(tiny_dir), num_kv_blocks=16, served_model_name=NAME)
    try:
        text = EngineMetrics(AsyncEngine(llm.engine), Gone()).render().decode()
        m = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for fam in text_string_to_metric_families(text) for s in fam.samples}
        total = llm.engine.stats()["kv_blocks"]["total"]
        assert config_blocks(m) == one(m, "kvpool:kv_blocks_held", model_name=NAME) == total
        assert one(m, "kvpool:kv_blocks_grantable", model_name=NAME) == 0
        assert not [k for k in m if k[0] == "kvpool:headroom_bytes"]  # elastic only
    finally:
        llm.engine.close()


def read_while_running(port: int, base: str, body: dict, attempts: int = 5):
    """The metrics read while one streamed request runs in the server (engine and server
    share one process, so it cannot be paused from outside): a read that finds the
    request already finished (its first line can arrive late on a busy machine) is not
    a sample of a running request, and the request is sent again."""
    for _ in range(attempts):
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            types, m = read(port)
            for _ in lines:
                pass
        if one(m, "vllm:num_requests_running", model_name=NAME) == 1:
            return types, m
    raise AssertionError(f"no read found the request running in {attempts} attempts")


def test_a_server_speaks_the_routers_protocol_with_elastic_meanings(start_daemon, tmp_path
                                                                     ) -> None:
    from adapters.serve_procs import Servers, complete, prompt

    from kvpool.engine.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", layers=2, hidden=128, heads=4, kv_heads=2,
                            vocab=512, seed=0)
    d = start_daemon(budget="8MiB")
    servers = Servers(model, tmp_path)
    hog = None
    try:
        s = servers.start(NAME, run_dir=d.run_dir, idle_timeout=300.0)
        servers.wait_healthy(120)
        types, idle = read(s.port)
        check_protocol(types, idle)
        assert one(idle, "kvpool:asleep", model_name=NAME) == 0
        assert one(idle, "vllm:num_requests_running", model_name=NAME) == 0
        assert one(idle, "kvpool:pool_free_bytes", model_name=NAME) > 0
        assert one(idle, "kvpool:max_bytes", model_name=NAME) > 0

        # a request running: its blocks are in use, counted over what the server holds
        body = {"prompt": prompt(1, 64), "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        types, busy = read_while_running(s.port, s.base, body)
        check_protocol(types, busy)
        assert one(busy, "vllm:kv_cache_usage_perc", model_name=NAME) > 0

        # another tenant takes every free page: nothing is grantable at once, so the
        # server's blocks are what it holds, far below its virtual maximum
        hog = connect("hog", run_dir=d.run_dir)
        free = one(read(s.port)[1], "kvpool:pool_free_bytes", model_name=NAME)
        hog.set_lease(int(free))

        def squeezed():
            t, m = read(s.port)
            return (t, m) if one(m, "kvpool:headroom_bytes", model_name=NAME) == 0 else None

        types, tight = wait_for(squeezed, 60, 0.05, "headroom 0 once the pool is leased")
        check_protocol(types, tight)
        assert one(tight, "kvpool:kv_blocks_grantable", model_name=NAME) == 0
        assert config_blocks(tight) == one(tight, "kvpool:kv_blocks_held", model_name=NAME)
        virtual = one(tight, "kvpool_engine_kv_blocks", model_name=NAME, state="used") + \
            one(tight, "kvpool_engine_kv_blocks", model_name=NAME, state="free")
        assert config_blocks(tight) < virtual  # not the static maximum
        assert config_blocks(idle) > config_blocks(tight)  # the room it had is gone
        body = {"prompt": prompt(3, 16), "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True}
        types, busy = read_while_running(s.port, s.base, body)
        check_protocol(types, busy)  # in use over what it holds, not over the maximum
        used = one(busy, "kvpool_engine_kv_blocks", model_name=NAME, state="used")
        held = one(busy, "kvpool:kv_blocks_held", model_name=NAME)
        usage = one(busy, "vllm:kv_cache_usage_perc", model_name=NAME)
        assert used > 0 and usage == used / held > used / virtual
        hog.set_lease(0)
        wait_for(lambda: one(read(s.port)[1], "kvpool:kv_blocks_grantable",
                             model_name=NAME) > 0, 60, 0.05, "room again after the lease")

        # asleep: it holds nothing, says so, and every value stays finite
        r = httpx.post(f"{s.base}/sleep", timeout=60)
        assert r.status_code == 200, r.text
        types, asleep = read(s.port)
        check_protocol(types, asleep)
        assert one(asleep, "kvpool:asleep", model_name=NAME) == 1
        assert one(asleep, "kvpool:kv_blocks_held", model_name=NAME) == 0
        assert one(asleep, "vllm:kv_cache_usage_perc", model_name=NAME) == 0
        r = complete(s.base, prompt(2, 32), 4)  # a request wakes it
        assert r.status_code == 200, r.text
        types, woken = read(s.port)
        check_protocol(types, woken)
        assert one(woken, "kvpool:asleep", model_name=NAME) == 0
    finally:
        if hog is not None:
            hog.close()
        servers.close()
