"""A request prefilled by one engine process and decoded by another, its KV handed over
as pages (no copy) through a real daemon: the pair's greedy tokens equal a single
engine's, the very same pages change tenant, the prefill engine's tenant holds them no
more, and killing either side mid-handoff or letting the ticket expire loses no memory.

Each engine is a real process (:mod:`.pd_worker`), elastic and request-aligned; this test
plays the router (it carries the handover message from one to the other)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import REPO, read_event, read_line
from kvpool.engine import Engine, EngineConfig, SamplingParams

WORKER = Path(__file__).with_name("pd_worker.py")
KV = "2MiB"
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
# block 16 tokens x 16 KiB, 64 KiB pages: a unit holds 4 blocks = 64 tokens, so these
# prompts end inside, at the end of and just past a unit, and decoding crosses units
LENGTHS = [5, 40, 63, 64, 65, 100, 130]


def prompt(n: int) -> list[int]:
    r = random.Random(n)
    return [r.randrange(8, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[int, list[int]]:
    """A single engine's greedy tokens for every prompt."""
    e = Engine(EngineConfig(model=str(tiny_dir), kv_cache_size=KV))
    for n in LENGTHS:
        e.add_request(prompt(n), SamplingParams(**GREEDY), str(n))
    out: dict[int, list[int]] = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                out[int(o.request_id)] = o.output_token_ids
    return out


def spawn(d, model: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--model", str(model), "--run-dir", str(d.run_dir),
           "--name", name, "--kv", KV]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    d.workers.append(proc)
    read_event(proc, "ready", timeout=120)
    return proc


def send(proc: subprocess.Popen, **msg) -> None:
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()


def pages(d, name: str) -> dict[int, list[int]]:
    """unit -> page frame numbers of the named tenant's group (the daemon's map)."""
    with d.monitor() as m:
        groups = m.map(name, pfns=True).groups
    assert len(groups) == 1, groups
    return {int(u): list(v) for u, v in (groups[0].pfns or {}).items()}


def tenants(d) -> dict[str, dict]:
    return {t["name"]: t for t in d.cli_json("ps")["tenants"]}


def accounted(d) -> dict[str, int]:
    """tenant -> mapped bytes, asserting (one daemon snapshot) that they and the weight
    sets add up to the pool's granted bytes: every granted page is some live tenant's
    KV or in a weight set, once."""
    s = d.stats()
    assert s.pool.granted == s.pool.weights + sum(t.mapped for t in s.tenants), s
    return {t.name: t.mapped for t in s.tenants}


def wait_for(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def prefill(proc, n: int, ttl: float = 10.0) -> dict:
    send(proc, cmd="prefill", id=str(n), prompt=prompt(n), params=GREEDY, to="decode",
         ttl=ttl)
    return read_event(proc, "handover")


def test_pair_equals_single_engine_and_the_pages_change_hands(start_daemon, tiny_dir,
                                                               reference):
    d = start_daemon(budget="8MiB")
    a, b = spawn(d, tiny_dir, "prefill"), spawn(d, tiny_dir, "decode")
    for n in LENGTHS:
        ho = prefill(a, n)
        h, given = ho["handover"], ho["units"]
        assert len(given) == -(-n // 64), "one unit per started 64 tokens: request-aligned"
        before = pages(d, "prefill")
        send(b, cmd="decode", handover=h, pause=True)  # it decodes on "go"
        claimed = read_event(b, "claimed")
        settled = read_event(a, "settled")
        assert settled["state"] == "claimed"
        assert not set(given) & set(settled["mapped"]), "the giver still maps given units"
        after_a, after_b = pages(d, "prefill"), pages(d, "decode")
        assert not set(given) & set(after_a), "the daemon still lists them as the giver's"
        # the same physical pages, now at the receiver's units, in block-table order
        assert [after_b[u] for u in claimed["units"]] == [before[u] for u in given]
        # the receiver's block table: same offsets inside the units it mapped them at
        per = h["blocks_per_chunk"]
        assert [x % per for x in claimed["block_ids"]] == [x % per for x in h["block_ids"]]
        send(b, cmd="go")
        done = read_event(b, "done")
        assert done["tokens"] == reference[n], f"prompt of {n} tokens"
        check_both(d, a, b)  # after every handoff: the giver's and the receiver's books
    assert set(accounted(d)) == {"prefill", "decode"}


def test_killing_the_giver_mid_handoff_loses_no_memory(start_daemon, tiny_dir, reference):
    d = start_daemon(budget="8MiB")
    a, b = spawn(d, tiny_dir, "prefill"), spawn(d, tiny_dir, "decode")
    h = prefill(a, 130, ttl=60)["handover"]  # in escrow now
    a.kill()
    a.wait()
    wait_for(lambda: "prefill" not in tenants(d), "the dead giver is dropped")
    send(b, cmd="decode", handover=h)
    assert "refused" in read_event_any(b, ("refused", "claimed"))["event"]
    send(b, cmd="check")
    assert read_event(b, "ok")["used"] == 0
    assert d.check() == []
    assert set(accounted(d)) == {"decode"}
    # the decode engine still takes handoffs from a new prefill engine
    a2 = spawn(d, tiny_dir, "prefill")
    send(b, cmd="decode", handover=prefill(a2, 65)["handover"])
    assert read_event(b, "done")["tokens"] == reference[65]
    assert read_event(a2, "settled")["state"] == "claimed"
    check_both(d, a2, b)


def test_killing_the_receiver_mid_handoff_loses_no_memory(start_daemon, tiny_dir):
    d = start_daemon(budget="8MiB")
    a, b = spawn(d, tiny_dir, "prefill"), spawn(d, tiny_dir, "decode")
    ho = prefill(a, 100)
    send(b, cmd="decode", handover=ho["handover"], hold=True)
    read_event(b, "claimed")
    b.kill()
    b.wait()
    assert read_event(a, "settled")["state"] == "claimed"
    wait_for(lambda: "decode" not in tenants(d), "the dead receiver is dropped")
    send(a, cmd="check")
    assert read_event(a, "ok")["used"] == 0
    assert d.check() == []
    assert set(accounted(d)) == {"prefill"}


def test_an_unclaimed_ticket_expires_and_the_giver_decodes_itself(start_daemon, tiny_dir,
                                                                  reference):
    d = start_daemon(budget="8MiB")
    a, b = spawn(d, tiny_dir, "prefill"), spawn(d, tiny_dir, "decode")
    ho = prefill(a, 65, ttl=0.5)
    settled = read_event(a, "settled")
    assert settled["state"] == "expired"
    assert set(ho["units"]) <= set(settled["mapped"]), "the giver keeps its pages"
    assert read_event(a, "done")["tokens"] == reference[65]
    send(b, cmd="decode", handover=ho["handover"])  # a stale ticket
    assert read_event_any(b, ("refused", "claimed"))["event"] == "refused"
    check_both(d, a, b)


def check_both(d, giver: subprocess.Popen, receiver: subprocess.Popen) -> None:
    """Both sides of a handoff whole: each engine's and pool's own integrity check (and
    no block left in use), then the daemon's books."""
    for proc in (giver, receiver):
        send(proc, cmd="check")
        assert read_event(proc, "ok")["used"] == 0
    assert d.check() == []


def read_event_any(proc: subprocess.Popen, events: tuple[str, ...],
                   timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = read_line(proc, max(0.0, deadline - time.monotonic()))
        except AssertionError:
            raise AssertionError(f"none of {events} in {timeout} s") from None
        if line is None:
            raise AssertionError(f"worker ended: rc={proc.poll()}")
        msg = json.loads(line)
        if msg.get("event") in events:
            return msg
        if msg.get("event") == "error":
            raise AssertionError(f"worker failed: {msg}")
