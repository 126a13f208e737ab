"""Several hosts, simulated (issue 38 item 5): two "hosts", each a network namespace of its
own with a daemon and a fleet on its own address, seen from outside the way a cluster
router sees them.

The router's side here: it reads every host's endpoints file (file discovery), scrapes
each endpoint's ``/metrics`` at the address the file gives, checks the protocol's names
and types, and subscribes to each host's KV events (vLLM's wire: a PUB socket per
engine). A burst on one host shows in that host's gauges while it runs, not in the
other's, and as stored blocks in that host's events; a model put to sleep on the other
host says so in its gauges, in its endpoint's state, and with a clear in its events.

Network namespaces need root (CAP_NET_ADMIN) and ``ip``; where they cannot be made the
test skips with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import yaml
import zmq

from daemon.helpers import wait_for
from kvpool import launch
from kvpool.engine.kv_events import KVEventBatch

from .prom import of_model, samples
from .test_fleet_life import DEADLINE_S, REPO, TOP, Fleet, fleet_file

pytestmark = pytest.mark.slow

#: what the router reads of each endpoint (name -> type): the protocol's table
PROTOCOL = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "kvpool:asleep": "gauge",
}
EVENTS_PORT = 5557  # the same port on every host: each namespace has its own
PROMPT = list(range(20, 84))  # 64 tokens: whole blocks to cache


@dataclass
class Host:
    """A network namespace joined to the test's by a veth pair; ``address`` is its side."""

    ns: str
    veth: str
    address: str

    def run(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _make_host(tag: str, i: int, subnet: str) -> Host:
    ns, veth = f"kvp{tag}h{i}", f"kv{tag}v{i}"
    outside, inside = f"{subnet}.{4 * i + 1}", f"{subnet}.{4 * i + 2}"
    _ip("netns", "add", ns)
    host = Host(ns, veth, inside)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{outside}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{inside}/30", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    except BaseException:
        _drop_host(host)
        raise
    return host


def _drop_host(host: Host) -> None:
    subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", host.veth], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[Host]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    pid = os.getpid()
    tag, subnet = f"{pid % 100000}", f"10.{100 + pid % 100}.{(pid // 100) % 256}"
    made: list[Host] = []
    try:
        for i in range(2):
            made.append(_make_host(tag, i, subnet))
    except (subprocess.CalledProcessError, OSError) as e:
        for h in made:
            _drop_host(h)
        why = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"network namespaces cannot be made here: {why.strip()}")
    try:
        yield made
    finally:
        for h in made:
            _drop_host(h)


def _entry(name: str, checkpoint: Path) -> str:
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{EVENTS_PORT}", "topic": "kv"})
    return (f'[[models]]\nname = "{name}"\ncheckpoint = "{checkpoint}"\nreplicas = 1\n'
            f'kv_cache_size = "2MiB"\nmax_num_seqs = 4\n'
            f"args = ['--max-model-len', '512', '--kv-events-config', '{events}']\n"
            f"eager = true\n")


@dataclass
class HostFleet:
    host: Host
    model: str
    fleet: Fleet
    endpoints: Path


@pytest.fixture(scope="module")
def fleets(hosts, tmp_path_factory) -> Iterator[list[HostFleet]]:
    from kvpool.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("multi-host")
    model = make_tiny_model(d / "tiny", layers=2, hidden=128, heads=4, kv_heads=2, vocab=512,
                            seed=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    out: list[HostFleet] = []
    try:
        for i, (host, name) in enumerate(zip(hosts, ("alpha", "beta"))):
            port = 8000 + i  # each host has its own ports: the same number would do
            toml = fleet_file(d / f"{name}.toml", port, [_entry(name, model)],
                              fleet=f'host = "{host.address}"\n')
            eps = d / f"endpoints-{name}.yaml"
            argv = host.run(*TOP, "fleet", str(toml), "--with-daemon", "--log-dir",
                            str(d / f"logs-{name}"), "--endpoints-file", str(eps),
                            "--endpoints-address", host.address)
            proc = launch.spawn_process(argv, d / f"fleet-{name}.log", cwd=REPO,
                                        new_session=True, base_env=env)
            fl = Fleet(proc, f"http://{host.address}:{port}", d / f"fleet-{name}.log")
            out.append(HostFleet(host, name, fl, eps))
        for hf in out:
            hf.fleet.wait_healthy()
        yield out
    finally:
        for hf in out:
            hf.fleet.stop()


# ---- the router's side ------------------------------------------------------------------
def discover(files: list[Path]) -> list[dict]:
    """Every endpoint of every host's file (the router's file discovery)."""
    found = []
    for f in files:
        found += yaml.safe_load(f.read_text())["endpoints"] or []
    return found


def scrape(endpoint: dict) -> tuple[dict[str, str], dict[tuple, float]]:
    return samples(httpx.get(f"http://{endpoint['address']}:{endpoint['port']}/metrics",
                             timeout=30).text)


def scrape_all(files: list[Path]) -> dict[str, dict]:
    """model -> its endpoint's samples, after checking the protocol's names and types."""
    out = {}
    for ep in discover(files):
        assert ep["labels"]["llm-d.ai/engine-type"] == "kvpool", ep
        types, got = scrape(ep)
        model = ep["labels"]["model"]
        for name, kind in PROTOCOL.items():
            assert types.get(name) == kind, (ep, name)
            of_model(got, name, model)
        assert all(v >= 0 and v == v for v in got.values()), ep
        out[model] = got
    return out


class Events:
    """A subscriber to one host's KV events (vLLM's wire), from outside the host."""

    def __init__(self, host: Host) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(f"tcp://{host.address}:{EVENTS_PORT}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.seen: list = []

    def until(self, done, what: str, timeout_s: float = DEADLINE_S) -> list:
        """Read events until ``done(seen)``."""
        deadline = time.monotonic() + timeout_s
        while not done(self.seen):
            left = deadline - time.monotonic()
            assert left > 0, f"{what}: {[type(e).__name__ for e in self.seen]}"
            if self.sock.poll(int(min(left, 1.0) * 1000)):
                _, _, payload = self.sock.recv_multipart()
                self.seen += self.decoder.decode(payload).events
        return self.seen

    def close(self) -> None:
        self.sock.close(linger=0)


def has(kind: str):
    return lambda seen: any(type(e).__name__ == kind for e in seen)


def cached(seen: list) -> set[int]:
    """What a router believes the host caches: stored, not removed since the last clear."""
    out: set[int] = set()
    for e in seen:
        name = type(e).__name__
        if name == "BlockStored":
            out.update(e.block_hashes)
        elif name == "BlockRemoved":
            out.difference_update(e.block_hashes)
        elif name == "AllBlocksCleared":
            out.clear()
    return out


def test_a_router_outside_sees_each_hosts_endpoints_gauges_and_events(fleets) -> None:
    files = [hf.endpoints for hf in fleets]
    alpha, beta = fleets
    wait_for(lambda: {e["labels"]["model"]: e["labels"]["kvpool.io/state"]
                      for e in discover(files)} == {"alpha": "awake", "beta": "awake"},
             DEADLINE_S, 0.1, "both hosts' models awake in their files")
    eps = {e["labels"]["model"]: e for e in discover(files)}
    assert eps["alpha"]["address"] == alpha.host.address
    assert eps["beta"]["address"] == beta.host.address
    idle = scrape_all(files)
    for model in ("alpha", "beta"):
        assert of_model(idle[model], "vllm:num_requests_running", model) == 0
        assert of_model(idle[model], "kvpool:asleep", model) == 0

    # a burst on host alpha: its gauges show it while it runs, beta's do not; its events
    # say which blocks it cached
    ev_alpha, ev_beta = Events(alpha.host), Events(beta.host)
    try:
        # alpha's engine is stopped (SIGSTOP) so the request stays in flight however fast
        # the tiny model is; the gauges are read while it is
        (pid,) = [t["pid"] for t in alpha.fleet.ps().values() if t["kind"] == "engine"]
        body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 64, "temperature": 0,
                "ignore_eos": True}
        os.kill(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as ex:
                fut = ex.submit(httpx.post, f"{alpha.fleet.url}/v1/completions", json=body,
                                timeout=DEADLINE_S)
                busy = wait_for(lambda: (lambda m: m if of_model(
                    m["alpha"], "vllm:num_requests_running", "alpha") == 1 else None)(
                        scrape_all(files)), DEADLINE_S, 0.1, "alpha's burst in its gauges")
                assert of_model(busy["beta"], "vllm:num_requests_running", "beta") == 0
                os.kill(pid, signal.SIGCONT)
                assert fut.result().status_code == 200
        finally:
            os.kill(pid, signal.SIGCONT)
        seen = ev_alpha.until(has("BlockStored"), "no block stored on alpha")
        assert len(cached(seen)) >= 2

        # beta caches something, then is put to sleep on its host: its gauges, its
        # endpoint's state and its events say so; alpha stays awake
        small = {"model": "beta", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                 "ignore_eos": True}
        assert httpx.post(f"{beta.fleet.url}/v1/completions", json=small,
                          timeout=DEADLINE_S).status_code == 200
        before = len(ev_beta.until(has("BlockStored"), "no block stored on beta"))
        out = subprocess.run([*TOP, "sleep", "beta", "--run-dir", str(beta.fleet.run_dir())],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out
        wait_for(lambda: {e["labels"]["model"]: e["labels"]["kvpool.io/state"]
                          for e in discover(files)} == {"alpha": "awake", "beta": "asleep"},
                 DEADLINE_S, 0.1, "beta asleep in its host's file, alpha awake")
        asleep = wait_for(lambda: (lambda m: m if of_model(m["beta"], "kvpool:asleep", "beta") == 1
                                   else None)(scrape_all(files)), DEADLINE_S, 0.1,
                          "beta's gauge says asleep")
        assert of_model(asleep["alpha"], "kvpool:asleep", "alpha") == 0
        assert of_model(asleep["beta"], "vllm:kv_cache_usage_perc", "beta") == 0
        # the router learns that beta caches nothing now (removals or a clear)
        ev_beta.until(lambda seen: len(seen) > before and not cached(seen),
                      "beta's events still show cached blocks after its sleep")
    finally:
        ev_alpha.close()
        ev_beta.close()
