"""vLLM tenants on vLLM's own KV-events stream when kvpool takes KV back (issue 38 item
2): one real vLLM CPU server (``--kv-events-config``, ZMQ PUB + replay) of the tiny Llama
on a real daemon; a subscriber that decodes with vLLM's own event classes and predicts
prefix hits the way a precise-prefix router does (the ``BlockStored`` chains).

* a burst: the subscriber rebuilds every prompt's cached blocks;
* a reclaim (a lease that needs the engine's cache, the engine idle): the subscriber
  loses exactly the blocks the engine says its shrink evicted, and its prediction for
  a prompt equals the engine's own prefix hit (``cached_tokens``);
* a sleep (``kvpool sleep``): the subscriber holds no block;
* a SIGKILL and a restart on the same endpoints: the new stream starts with
  ``AllBlocksCleared``, so a router that kept the dead engine's blocks forgets them.

Beside them, on the same server: kvpool's gauges on vLLM's own ``/metrics`` (vLLM's names
kept), and the daemon's endpoints file listing the server (``KVPOOL_PORT``) as engine
type ``vllm``, asleep when it sleeps, gone when it is killed.

The engine stays idle after each taking: without kvpool's own publishing, vLLM would
send these events only after its next step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from .vllm_procs import REPO, VllmServers, complete, remove_daemon, start_daemon  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
NAME = "tiny-events"
DEADLINE_S = 120.0
CHUNK = 2 * 65536  # the tiny model's release unit: one KV block (128 tokens) of both layers
BUDGET = 4 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    eps = tmp_path_factory.mktemp("eps") / "endpoints.yaml"
    d = start_daemon(budget="4MiB", page_size=65536, extra=(
        "--reclaim-timeout", "60", "--endpoints-file", str(eps),
        "--endpoints-address", "10.1.1.1"))
    d.endpoints = eps
    yield d
    remove_daemon(d)


def _listed(daemon) -> dict | None:
    """The daemon's endpoints-file entry of this server (None: not listed)."""
    import yaml

    doc = yaml.safe_load(daemon.endpoints.read_text()) or {}
    return next((e for e in doc.get("endpoints") or [] if e["labels"]["model"] == NAME),
                None)


def _events_args(tmp) -> tuple[str, ...]:
    return ("--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp}/pub",
        "replay_endpoint": f"ipc://{tmp}/replay", "topic": "kv"}))


def _replay(tmp) -> list:
    """Every event since sequence 0, decoded with vLLM's own classes."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from engine.test_kv_events import _replay_all

    return _replay_all(f"ipc://{tmp}/replay", msgspec.msgpack.Decoder(KVEventBatch))


class Router:
    """What a precise-prefix router knows: the live hashes and the chains that stored
    them (``(parent hash, a block's tokens) -> hash``)."""

    def __init__(self, events: list, known: set | None = None) -> None:
        from engine.test_kv_events import rebuild

        self.events = events
        self.live = rebuild(events, set(known or ()))
        self.chain: dict = {}
        self.block_size = 0
        for e in events:
            if type(e).__name__ != "BlockStored":
                continue
            bs, parent = e.block_size, e.parent_block_hash
            self.block_size = bs
            for i, h in enumerate(e.block_hashes):
                self.chain[(parent, tuple(e.token_ids[i * bs:(i + 1) * bs]))] = h
                parent = h

    def hit(self, ids: list[int]) -> int:
        """The prefix tokens a request for ``ids`` finds cached (vLLM never counts a
        prompt's last token: at most ``(len - 1) // block_size`` blocks)."""
        bs, parent, n = self.block_size, None, 0
        for i in range((len(ids) - 1) // bs):
            h = self.chain.get((parent, tuple(ids[i * bs:(i + 1) * bs])))
            if h is None or h not in self.live:
                break
            parent, n = h, n + 1
        return n * bs


def _wait_router(tmp, ok, what: str) -> Router:
    """Until the replayed stream satisfies ``ok`` (the publisher thread sends after the
    engine queued); fails saying ``what`` with the last state."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        r = Router(_replay(tmp))
        if ok(r):
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: the stream never showed it ({len(r.live)} live "
                                 f"hashes, last events {r.events[-3:]})")
        time.sleep(0.2)


def _settled(tmp) -> Router:
    """The stream once two replays in a row agree (what the last request published has
    been sent)."""
    seen = _replay(tmp)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        time.sleep(0.5)
        now = _replay(tmp)
        if len(now) == len(seen):
            return Router(now)
        assert time.monotonic() < deadline, "the stream never settled"
        seen = now


def _wait(pred, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.2)


def _probe(base: str, ids: list[int]) -> int:
    """The engine's own prefix hit for ``ids`` (a request; it caches them again)."""
    r = complete(base, NAME, ids, 2)
    return int((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _prompt_ids(base: str, text: str) -> list[int]:
    r = complete(base, NAME, text, 2)
    return list(r["choices"][0]["prompt_token_ids"])


def _evicted_by_shrinks(logs: str) -> int:
    return sum(int(m) for m in re.findall(r"^kvpool: shrink of \d+ B: evicted (\d+)", logs,
                                          flags=re.M))


def _gauges(base: str) -> dict[str, float]:
    """The server's ``/metrics`` samples of this model, by name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("model_name") == NAME}


def _wait_gauges(base: str, ok, what: str) -> dict[str, float]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        g = _gauges(base)
        if ok(g):
            return g
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {sorted(g.items())}")
        time.sleep(0.2)


def _cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.cli.main", args[0], "--run-dir",
                           str(daemon.run_dir), *args[1:]], capture_output=True, text=True,
                          timeout=DEADLINE_S, cwd=REPO)


def test_takings_and_a_restart_reach_the_router(tiny_model, daemon, tmp_path):
    tmp = tmp_path / "ev"
    tmp.mkdir()
    from kvpool.demo.cluster import free_port

    servers = VllmServers(tiny_model, tmp_path)
    # no idle release: only the takings below remove blocks; KVPOOL_PORT: the engine
    # core registers the server's endpoint (the daemon's endpoints file lists it)
    port = free_port()
    srv = servers.start(NAME, daemon.run_dir, _events_args(tmp), port=port,
                        KVPOOL_IDLE_TIMEOUT="3600", KVPOOL_PORT=str(port))
    try:
        servers.wait_healthy(srv)
        e = _wait(lambda: _listed(daemon), "the server in the daemon's endpoints file")
        assert (e["address"], e["port"]) == ("10.1.1.1", port)
        assert e["labels"]["llm-d.ai/engine-type"] == "vllm"
        assert e["labels"]["kvpool.io/state"] == "awake"
        texts = [f"Story {i}: " + " ".join(f"w{i}x{j}" for j in range(100)) for i in range(6)]
        ids = [_prompt_ids(srv.base, t) for t in texts]  # each request caches its prompt

        # the burst: the last prompt's full blocks are on the stream (an elastic pool
        # evicts cached blocks, LRU first, before it asks kvpool for more: earlier
        # prompts may have lost theirs, and the stream says so too), and the engine's own
        # prefix hit for it is the router's prediction
        last = ids[-1]
        before = _wait_router(tmp, lambda r: r.block_size > 0 and r.hit(last) == (
            len(last) - 1) // r.block_size * r.block_size, "the burst's cached blocks")
        assert before.hit(last) >= 2 * before.block_size
        assert _probe(srv.base, last) == before.hit(last)  # the engine agrees
        before = _settled(tmp)  # (with whatever that probe evicted)

        # kvpool's gauges beside vLLM's own names on vLLM's /metrics, the daemon's numbers
        t = daemon.tenant(NAME)
        g = _wait_gauges(srv.base, lambda g: g.get("kvpool:granted_bytes", 0) > 0,
                         "kvpool's gauges of an awake tenant")
        assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc"} <= set(g), sorted(g)
        assert (g["kvpool:asleep"], g["kvpool:min_bytes"], g["kvpool:max_bytes"]) == (
            0, t["min"], t["max"])
        assert 0 <= g["kvpool:pool_free_bytes"] < BUDGET

        # a reclaim, the engine idle: a lease that leaves the engine its null block's
        # chunk and chunks for half its cached blocks (a block is a chunk here)
        keep = 1 + len(before.live) // 2
        logs0 = len(srv.logs())
        out = _cli(daemon, "lease", str(BUDGET - keep * CHUNK), "--timeout", "60", "--", "true")
        assert out.returncode == 0, out.stderr
        evicted = _evicted_by_shrinks(srv.logs()[logs0:])
        assert evicted > 0, srv.logs()[-3000:]
        after = _wait_router(tmp, lambda r: len(r.events) > len(before.events) and len(
            r.live) == len(before.live) - evicted, f"the reclaim's {evicted} evicted blocks")
        assert after.live < before.live  # only removals
        dropped = [p for p in ids if after.hit(p) < before.hit(p)]
        assert dropped, "the reclaim dropped no prompt's blocks"
        assert _probe(srv.base, dropped[0]) == after.hit(dropped[0])  # the engine agrees

        # a sleep (kvpool's, by the CLI): every block gone from the stream
        out = _cli(daemon, "sleep", NAME, "--wait", "60")
        assert (out.returncode, out.stdout.strip()) == (0, f"{NAME}: asleep"), out
        asleep = _wait_router(tmp, lambda r: not r.live,
                              "the sleep's clear")
        assert asleep.hit(ids[0]) == 0
        _wait(lambda: (_listed(daemon) or {}).get("labels", {}).get("kvpool.io/state")
              == "asleep", "asleep in the daemon's endpoints file")
        _wait_gauges(srv.base, lambda g: (g.get("kvpool:asleep"), g.get(
            "kvpool:granted_bytes")) == (1, 0), "the gauges of a sleeping tenant")
        assert _probe(srv.base, ids[0]) == 0  # woken by the request, nothing cached

        # SIGKILL (no goodbye on the stream), then a new engine on the same endpoints
        known = Router(_replay(tmp)).live
        assert known  # the probe cached its prompt again: a router would remember it
        engines = srv.engine_pids()  # (each killed too: one outside the group lives on)
        srv.kill()
        for pid in engines:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        srv.proc.wait(60)
        _wait(lambda: _listed(daemon) is None, lambda: (
            f"the killed server gone from the file: {daemon.endpoints.read_text()}; "
            f"{daemon.ps()}; {srv.engine_pids()}"))
        srv = servers.start(NAME, daemon.run_dir, _events_args(tmp),
                            KVPOOL_IDLE_TIMEOUT="3600")
        servers.wait_healthy(srv)
        events = _replay(tmp)
        assert events and type(events[0]).__name__ == "AllBlocksCleared", events[:3]
        assert not Router(events, known).live  # the reconnecting router forgot them
    finally:
        servers.close()
