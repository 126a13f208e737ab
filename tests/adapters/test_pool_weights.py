"""The bundled engine's weights in the pool (issue 22, docs/ARCHITECTURE.md "Weight
sets"), with a real daemon and real ``kvpool serve`` processes: servers of one checkpoint
hold one copy and answer as a server with local weights does; another checkpoint never
attaches that copy; killing every holder leaves the books clean and the set cached (and
evictable); release/restore, warm and cold, give the same tokens; the parameters cannot be
written once sealed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpool.client_lib.weights import WeightSet
from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine_adapters.bundled import Settings, bridge_of, enable

from daemon.helpers import REPO, wait_for

from .serve_procs import Servers, complete, kill_all, prompt

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [prompt(i, 20 + 7 * i) for i in range(3)]


def pool_info(d) -> dict:
    return d.cli_json("ps")["pool"]


def headroom(d) -> int:
    """Bytes a grant could get now without evicting anything (Pool.available)."""
    p = pool_info(d)
    return p["budget"] - p["granted"] - p["leased"] - p["retained"]


def tenants(d) -> dict[str, dict]:
    return {t["name"]: t for t in d.cli_json("ps")["tenants"]}


def changed_copy(model: Path, dest: Path) -> Path:
    """``model`` with one byte of one tensor's data changed (the file's last byte)."""
    shutil.copytree(model, dest)
    (dest / ".kvpool-key.json").unlink(missing_ok=True)
    st = next(iter(sorted(dest.glob("*.safetensors"))))
    data = bytearray(st.read_bytes())
    data[-1] ^= 0x01
    st.write_bytes(bytes(data))
    return dest


def tokens(base: str) -> list[list[int]]:
    out = []
    for ids in PROMPTS:
        r = complete(base, ids, 12)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_servers_of_one_checkpoint_share_one_copy(tiny_model, start_daemon, servers,
                                                  tmp_path):
    d = start_daemon(budget="32MiB")
    a = servers.start("a", run_dir=d.run_dir, weights=None)  # the default: pool
    b = servers.start("b", run_dir=d.run_dir, weights=None)
    loc = servers.start("loc", run_dir=d.run_dir, weights=None, extra=("--weights", "local"))
    other = Servers(changed_copy(tiny_model, tmp_path / "changed"), tmp_path)
    try:
        c = other.start("c", run_dir=d.run_dir, weights=None)
        servers.wait_healthy(120)
        other.wait_healthy(120)
        held = tenants(d)
        one = held["a"]["weights"]
        assert one > 0 and held["b"]["weights"] == one and held["loc"]["weights"] == 0
        assert held["a"]["weight_sets"] == held["b"]["weight_sets"]
        assert held["c"]["weight_sets"] != held["a"]["weight_sets"]  # never attached
        pool = pool_info(d)
        assert pool["weight_sets"] == 2 and pool["weights"] == 2 * one  # a+b once, c once
        shown = d.cli("ps").stdout  # the table too: each server's weights and set
        assert "WEIGHTS" in shown and held["a"]["weight_sets"][0] in shown
        want = tokens(loc.base)
        assert tokens(a.base) == want and tokens(b.base) == want
        kill_all([a, b, c], 30.0)
        wait_for(lambda: set(tenants(d)) == {"loc"}, 60, what="the killed servers' sessions")
        assert d.check() == []
        pool = pool_info(d)
        assert pool["weights"] == pool["weights_cached"] == 2 * one  # cached, held by nobody
        # cached sets are the first memory a need takes back
        with d.connect("needy") as t:
            ws = WeightSet.create(t, "c3" * 32, headroom(d) + one)  # more than is free
            assert pool_info(d)["weights_cached"] <= one
            ws.detach()
        assert d.check() == []
    finally:
        other.close()


def elastic_engine(model: Path, d, name: str) -> Engine:
    cfg = EngineConfig(model=str(model), kv_cache_size="2MiB")
    # no idle release while the test measures the pool: an engine idle for its timeout
    # gives KV back on its own thread, and a headroom read before that and a create
    # after it would find room without evicting (seen once on a loaded host)
    bridge = enable(cfg, Settings(run_dir=str(d.run_dir), name=name, idle_timeout_s=3600.0))
    return Engine(bridge.config, bridge.seams)


def run(engine: Engine) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    return [outs[i] for i in ids]


def test_release_restore_warm_and_cold_give_the_same_tokens(tiny_model, start_daemon):
    d = start_daemon(budget="16MiB")
    reference = run(Engine(EngineConfig(model=str(tiny_model), kv_cache_size="2MiB")))
    e = elastic_engine(tiny_model, d, "sleepy")
    try:
        w = bridge_of(e).weights
        assert w is not None and w.held and w.loads in (0, 1)
        param = e.model.lm_head.weight
        addr = param.data_ptr()
        assert run(e) == reference
        w.release()
        assert not w.held and tenants(d)["sleepy"]["weights"] == 0
        assert pool_info(d)["weights_cached"] > 0  # still cached
        assert w.restore() is True  # warm: attached, not loaded
        assert w.held and param.data_ptr() == addr and run(e) == reference
        w.release()
        with d.connect("needy") as t:  # evict the cached set
            ws = WeightSet.create(t, "d4" * 32, headroom(d) + 1)
            assert pool_info(d)["weights"] == ws.npages * d.page_size
            ws.detach()
        loads = w.loads
        assert w.restore() is False  # cold: created and loaded again
        assert w.loads == loads + 1 and param.data_ptr() == addr
        assert run(e) == reference
        assert d.check() == []
    finally:
        e.close()
    assert d.check() == []


WRITER = textwrap.dedent("""
    import sys
    from kvpool.engine import Engine, EngineConfig
    from kvpool.engine_adapters.bundled import Settings, enable
    cfg = EngineConfig(model=sys.argv[1], kv_cache_size="1MiB")
    bridge = enable(cfg, Settings(run_dir=sys.argv[2], name="writer"))
    e = Engine(bridge.config, bridge.seams)
    w = e.model.model.layers[0].mlp.down_proj.weight
    print("ready", float(w[0, 0]), flush=True)
    w.data[0, 0] = 1.0
    print("wrote", flush=True)
""")


def test_writing_a_parameter_after_seal_faults(tiny_model, start_daemon):
    d = start_daemon(budget="16MiB")
    out = subprocess.run([sys.executable, "-c", WRITER, str(tiny_model), str(d.run_dir)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.stdout.startswith("ready"), out.stderr[-2000:]
    assert "wrote" not in out.stdout
    assert out.returncode in (-signal.SIGSEGV, -signal.SIGBUS), out.stderr[-2000:]
    wait_for(lambda: d.check() == [], 30, what="the writer's session dropped cleanly")


def test_weights_pool_without_elastic_is_one_clear_error(tiny_model):
    for args in (("--weights", "pool"), ("--elastic", "--sleep-after", "soon"),
                 ("--elastic", "--sleep-after", "-3")):
        out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "serve",
                              str(tiny_model), *args], capture_output=True, text=True,
                             timeout=60, cwd=REPO)
        assert out.returncode != 0
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "serve", str(tiny_model),
                          "--elastic"], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "KVPOOL_WEIGHTS": "shared"})
    assert out.returncode != 0 and out.stderr.strip().splitlines() == [
        "Error: bad KVPOOL_* setting: weights must be pool or local, not 'shared'"], out.stderr


def test_a_weight_set_the_daemon_refuses_is_one_line_and_a_nonzero_exit(tiny_model,
                                                                        start_daemon):
    """The daemon refuses the server's weight set (here past its max; issue 33 saw the
    pool's cap on sets): ``kvpool serve --weights pool`` says so in one line and exits 1,
    no traceback, and leaves nothing held."""
    d = start_daemon(budget="16MiB")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env.update(KVPOOL_RUN_DIR=str(d.run_dir), KVPOOL_MAX="64KiB")
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "serve", str(tiny_model),
                          "--elastic", "--weights", "pool", "--port", "1",
                          "--kv-cache-size", "4MiB", "--log-level", "warning"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 1, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "OVER_LIMIT" in lines[0], \
        out.stderr[-2000:]
    assert "weight set" in lines[0]
    wait_for(lambda: not tenants(d), 30, what="the refused server's session dropped")
    assert pool_info(d)["weights"] == 0 and d.check() == []


@pytest.mark.real_model
def test_two_smollm2_servers_share_one_set(smollm2_dir, start_daemon, tmp_path):
    d = start_daemon(budget="2GiB")
    s = Servers(smollm2_dir, tmp_path)
    try:
        a = s.start("a", run_dir=d.run_dir, weights=None)
        b = s.start("b", run_dir=d.run_dir, weights=None)
        s.wait_healthy(300)
        held = tenants(d)
        assert held["a"]["weights"] == held["b"]["weights"] > 500 << 20  # fp32 135 M
        assert pool_info(d)["weights"] == held["a"]["weights"]  # one copy
        r1 = complete(a.base, [1, 2, 3, 4], 8).json()["choices"][0]["text"]
        r2 = complete(b.base, [1, 2, 3, 4], 8).json()["choices"][0]["text"]
        assert r1 == r2
    finally:
        s.close()


from real_model import smollm2_dir  # noqa: E402, F401  (session fixture)
