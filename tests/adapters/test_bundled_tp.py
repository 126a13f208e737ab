"""The elastic bundled engine with tensor parallelism (issue 26): a TP=2 engine is one
kvpool gang on two host devices (``kvpool daemon --devices 2``); every grant and release
is made on both devices, all or none; it serves greedy tokens equal to the static TP=1
engine's while a lease on device 0 takes memory from it and gives it back."""

from __future__ import annotations

import os
import random
import threading

import pytest

from kvpool.client_lib import Monitor, connect
from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.engine_adapters.bundled import Settings, enable

PROMPTS = [
    [random.Random(i).randrange(8, 512) for _ in range(random.Random(-i).randrange(5, 60))]
    for i in range(8)
]
LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def run(engine: Engine, during=None) -> dict[str, list[int]]:  # noqa: ANN001
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, LONG, str(i))
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


class Devices:
    """Monitor sessions on device 0 and device 1."""

    def __init__(self, run_dir) -> None:  # noqa: ANN001
        self.mons = [Monitor(run_dir, device=dev) for dev in (0, 1)]

    def mapped(self, name: str) -> list[int]:
        """The tenant ``name``'s mapped bytes on device 0 and device 1, read while no
        grant or release landed in between (device 0 read before and after device 1)."""
        def on(dev: int) -> int:
            return sum(t.mapped for t in self.mons[dev].ps().tenants if t.name == name)

        while True:
            a, b = on(0), on(1)
            if on(0) == a:
                return [a, b]

    def check(self) -> list[str]:
        return [p for m in self.mons for p in m.check()]

    def close(self) -> None:
        for m in self.mons:
            m.close()


def test_tp2_gang_equals_static_tp1_across_a_lease(tiny_model, start_daemon):
    reference = run(Engine(EngineConfig(model=str(tiny_model), kv_cache_size="2MiB")))
    d = start_daemon(budget="1MiB", extra=("--devices", "2", "--reclaim-timeout", "60"))
    cfg = EngineConfig(model=str(tiny_model), kv_cache_size="1MiB", tensor_parallel_size=2)
    bridge = enable(cfg, Settings(run_dir=str(d.run_dir), name="tp", idle_timeout_s=1.0,
                                  weights="local"))
    e = Engine(bridge.config, bridge.seams)
    devices = Devices(d.run_dir)
    other = connect(name="trainer", run_dir=d.run_dir, kind="lease", device=0)
    lease: dict = {}
    granted = threading.Event()

    def take_lease() -> None:
        lease["obj"] = other.lease(768 << 10)
        lease["mapped_then"] = devices.mapped("tp")
        granted.set()

    thread = threading.Thread(target=take_lease)

    def during(step: int) -> None:
        held = devices.mapped("tp")
        assert held[0] == held[1], f"a half-granted gang: {held}"
        if "started" not in lease and held[0] >= 384 << 10:
            lease["started"] = step
            thread.start()
            assert granted.wait(120), "the lease was not granted while the engine ran"
            lease["granted"] = step
        if "granted" in lease and step == lease["granted"] + 10:
            lease["obj"].close()

    try:
        assert run(e, during) == reference
        assert "started" in lease, "the engine never held enough to be squeezed"
        thread.join(10)
        then = lease["mapped_then"]
        assert then[0] == then[1] <= 256 << 10, then  # the gang gave back on both
        assert not devices.check()
    finally:
        other.close()
        e.close()
    try:
        assert devices.mapped("tp") == [0, 0]
    finally:
        devices.close()


def test_tp2_elastic_on_a_one_device_daemon_is_one_line(tiny_model, start_daemon):
    """``kvpool serve --elastic --tensor-parallel-size 2`` against a daemon that serves
    one device: the gang is refused, one line, exit 1, nothing held."""
    import subprocess
    import sys

    d = start_daemon(budget="1MiB")
    r = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "serve", str(tiny_model),
                        "--elastic", "--tensor-parallel-size", "2", "--port", "1"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVPOOL_RUN_DIR": str(d.run_dir)})
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "cannot make the 2 ranks a kvpool gang on devices [0, 1]" in last, r.stderr
    assert "Traceback" not in r.stderr
    assert d.cli_json("ps")["tenants"] == []
