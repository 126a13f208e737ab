"""Warm restart with real processes: an idle engine hands its prefix cache to a new
engine process as pages; the new one serves the repeated prompts with prefix-cache hits
and the same tokens, the very same pages changed tenant, the memory is accounted once
(moved, not added), and an unclaimed offer leaves the old engine as it was.

With its in-flight requests (decoding, part way through a prefill, waiting): they finish
on the new engine with exactly the tokens of an uninterrupted engine, the pages holding
their KV change tenant with the cache's, an unclaimed offer lets the old engine finish
them itself, a new engine killed after its claim gives the memory back to the pool, and
a malformed handover is refused whole (one line) without spending the ticket."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import REPO, read_event
from kvpool.engine import Engine, EngineConfig, SamplingParams

from .worker_loop import finish_all
from .test_pd_handoff import (GREEDY, KV, WORKER, accounted, pages, prompt, send, tenants,
                              wait_for)

LENGTHS = [70, 130, 200]


def spawn(d, model, name: str) -> subprocess.Popen:
    return start_worker(d, WORKER, model, name, "--no-aligned")


def start_worker(d, script, model, name: str, *args: str) -> subprocess.Popen:
    """A worker process (``script``) of tenant ``name`` on daemon ``d``, once ready."""
    cmd = [sys.executable, str(script), "--model", str(model), "--run-dir", str(d.run_dir),
           "--name", name, "--kv", KV, *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    d.workers.append(proc)
    read_event(proc, "ready", timeout=120)
    return proc


def settled_of(old) -> dict:
    """The giver's ``settled`` event, its engine whole after the handoff (claimed or
    not: ``check_integrity`` on the giver's side too)."""
    settled = read_event(old, "settled")
    assert settled["integrity"] == "ok", settled["integrity"]
    return settled


def run(proc, n: int, rid: str) -> dict:
    send(proc, cmd="run", id=rid, prompt=prompt(n), params=GREEDY)
    return read_event(proc, "done")



def assert_same_pages_moved(d, given, settled, before_old, before_new, granted) -> None:
    """The old tenant's ``given`` units are gone from it (its own books and the daemon's);
    the very same pages are the new tenant's now, and none was created for it."""
    assert not set(given) & set(settled["mapped"]) and not set(given) & set(pages(d, "old"))
    after_new = pages(d, "new")
    moved = sorted(map(tuple, (after_new[u] for u in after_new if u not in before_new)))
    assert moved == sorted(map(tuple, (before_old[u] for u in given)))
    assert d.stats().pool.granted == granted

def test_the_new_engine_takes_over_the_cache(start_daemon, tiny_dir):
    d = start_daemon(budget="8MiB")
    old = spawn(d, tiny_dir, "old")
    first = {n: run(old, n, f"a{n}") for n in LENGTHS}
    assert all(r["hit"] == 0 for r in first.values())
    would = {}  # what the old engine's cache would give each prompt now
    for n in LENGTHS:
        send(old, cmd="probe", prompt=prompt(n))
        would[n] = read_event(old, "hit")["tokens"]
    assert sum(would.values()) > 0
    new = spawn(d, tiny_dir, "new")
    granted = d.stats().pool.granted
    held = tenants(d)
    before_old, before_new = pages(d, "old"), pages(d, "new")
    send(old, cmd="export", to="new")
    cache = read_event(old, "cache")
    send(new, cmd="import", cache=cache["cache"])
    adopted = read_event(new, "adopted")
    assert adopted["entries"] > 0 and adopted["cached"] == adopted["entries"]
    settled = settled_of(old)
    assert settled["state"] == "claimed"
    assert_same_pages_moved(d, cache["units"], settled, before_old, before_new, granted)
    now = tenants(d)
    page = d.page_size
    assert now["old"]["mapped"] == held["old"]["mapped"] - len(cache["units"]) * page
    assert now["new"]["mapped"] == held["new"]["mapped"] + len(cache["units"]) * page
    assert now["old"]["mapped"] + now["new"]["mapped"] == granted  # once, not twice
    # the new engine's cache answers every prompt as the old one's did
    for n in LENGTHS:
        send(new, cmd="probe", prompt=prompt(n))
        assert read_event(new, "hit")["tokens"] == would[n], f"prompt of {n}"
    # and the repeated prompts hit it and give the same tokens (the first exactly; later
    # ones may find part of it evicted by the earlier runs, as on any engine)
    hits = []
    for n in sorted(LENGTHS, key=lambda n: -would[n]):
        again = run(new, n, f"b{n}")
        hits.append(again["hit"])
        assert again["tokens"] == first[n]["tokens"]
    assert hits[0] == max(would.values()) > 0
    send(new, cmd="check")
    assert read_event(new, "ok")["used"] == 0
    old.kill()  # the retired engine goes; nothing of the new one's is lost
    old.wait()
    assert d.check() == []


def test_an_unclaimed_cache_offer_expires_and_the_old_engine_keeps_it(start_daemon,
                                                                      tiny_dir):
    d = start_daemon(budget="8MiB")
    old = spawn(d, tiny_dir, "old")
    first = run(old, 130, "a")
    send(old, cmd="export", to="new", ttl=0.5)
    cache = read_event(old, "cache")
    settled = settled_of(old)
    assert settled["state"] == "expired"
    assert set(cache["units"]) <= set(settled["mapped"])
    again = run(old, 130, "b")
    assert again["hit"] > 0 and again["tokens"] == first["tokens"]
    send(old, cmd="check")
    assert read_event(old, "ok")["used"] == 0
    assert d.check() == []


# --- in-flight requests move too --------------------------------------------------------

WARM_WORKER = WORKER.with_name("warm_worker.py")
SEQS, BATCH = 3, 64  # 3 running at most, 64 tokens a step: prefills take several steps
LONG = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": 40, "temperature": 0.8, "seed": 7, "ignore_eos": True}


def in_flight_requests() -> list[dict]:
    """a and b share a 128-token prefix (b hits a's blocks); c's prefill takes 4 steps;
    d waits for a seat (3 at most). After 5 steps: a, b decode, c prefills, d waits. a
    samples with its own seed: its generator's state moves mid-stream."""
    return [{"id": "a", "prompt": prompt(130), "params": SEEDED},
            {"id": "b", "prompt": prompt(130)[:128] + prompt(22), "params": LONG},
            {"id": "c", "prompt": prompt(200), "params": LONG},
            {"id": "d", "prompt": prompt(40), "params": LONG}]


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir) -> dict[str, list[int]]:
    """One engine, never interrupted, same scheduling limits: each request's tokens."""
    e = Engine(EngineConfig(model=str(tiny_dir), kv_cache_size=KV, max_num_seqs=SEQS,
                            max_num_batched_tokens=BATCH))
    for r in in_flight_requests():
        e.add_request(r["prompt"], SamplingParams(**r["params"]), r["id"])
    return finish_all(e)


def spawn_warm(d, model, name: str) -> subprocess.Popen:
    return start_worker(d, WARM_WORKER, model, name, "--max-num-seqs", str(SEQS),
                        "--max-num-batched-tokens", str(BATCH))


def start_mid_generation(old) -> dict:
    send(old, cmd="start", reqs=in_flight_requests(), steps=5)
    started = read_event(old, "started")["reqs"]
    assert {r["state"] for r in started.values()} == {"decode", "prefill", "waiting"}, started
    assert started["a"]["out"] and started["b"]["out"]
    return started


def test_in_flight_requests_move_and_finish_as_if_uninterrupted(start_daemon, tiny_dir,
                                                                 uninterrupted):
    d = start_daemon(budget="8MiB")
    old = spawn_warm(d, tiny_dir, "old")
    started = start_mid_generation(old)
    new = spawn_warm(d, tiny_dir, "new")
    granted = d.stats().pool.granted
    before_old, before_new = pages(d, "old"), pages(d, "new")
    send(old, cmd="export", to="new")
    cache = read_event(old, "cache")
    moving = {r["request_id"]: r for r in cache["cache"]["requests"]}
    assert list(moving) == ["a", "b", "c"] + ["d"], "running first, then waiting, in order"
    assert moving["d"]["block_ids"] == [] and moving["a"]["block_ids"]
    shared = set(moving["a"]["block_ids"]) & set(moving["b"]["block_ids"])
    assert shared, "a and b share their prefix blocks (one chunk, two holders)"
    send(new, cmd="import", cache=cache["cache"])
    adopted = read_event(new, "adopted")
    assert adopted["requests"] == ["a", "b", "c", "d"]
    assert (adopted["running"], adopted["waiting"]) == (3, 1)
    settled = settled_of(old)
    assert settled["state"] == "claimed"
    assert (settled["detached"], settled["requests"]) == (0, 0), "nothing left on the old"
    assert_same_pages_moved(d, cache["units"], settled, before_old, before_new, granted)
    assert sum(accounted(d).values()) == granted  # once, not twice
    # every request's whole output equals the uninterrupted engine's, token for token
    done = read_event(new, "done", timeout=120)["tokens"]
    assert done == uninterrupted
    for rid, s in started.items():
        assert done[rid][:len(s["out"])] == s["out"]
    send(new, cmd="check")
    assert read_event(new, "ok")["used"] == 0
    old.kill()
    old.wait()
    wait_for(lambda: "old" not in tenants(d), "the retired engine's tenant goes")
    assert set(accounted(d)) == {"new"}
    assert d.check() == []


def test_an_unclaimed_in_flight_offer_expires_and_the_old_engine_finishes(
        start_daemon, tiny_dir, uninterrupted):
    d = start_daemon(budget="8MiB")
    old = spawn_warm(d, tiny_dir, "old")
    start_mid_generation(old)
    send(old, cmd="export", to="nobody", ttl=0.5)
    cache = read_event(old, "cache")
    settled = settled_of(old)
    assert settled["state"] == "expired"
    assert set(cache["units"]) <= set(settled["mapped"]), "the old engine keeps its pages"
    assert settled["requests"] == 4 and settled["detached"] == 0
    assert read_event(old, "done", timeout=120)["tokens"] == uninterrupted
    send(old, cmd="check")
    assert read_event(old, "ok")["used"] == 0
    assert d.check() == []


def test_killing_the_new_engine_after_its_claim_returns_the_memory(start_daemon, tiny_dir):
    d = start_daemon(budget="8MiB")
    old = spawn_warm(d, tiny_dir, "old")
    start_mid_generation(old)
    new = spawn_warm(d, tiny_dir, "new")
    send(old, cmd="export", to="new")
    send(new, cmd="import", cache=read_event(old, "cache")["cache"], hold=True)
    read_event(new, "adopted")
    assert settled_of(old)["state"] == "claimed"
    new.kill()
    new.wait()
    wait_for(lambda: "new" not in tenants(d), "the dead new engine is dropped")
    assert set(accounted(d)) == {"old"}
    assert d.check() == []


def _broken(c: dict) -> dict[str, dict]:
    """Handovers a hostile or buggy peer could send, each wrong in one way."""
    def variant(change) -> dict:
        x = json.loads(json.dumps(c))
        change(x)
        return x

    r0 = c["requests"][0]
    return {
        "block id out of range": variant(
            lambda x: x["requests"][0]["block_ids"].__setitem__(0, 10 ** 9)),
        "computed beyond tokens": variant(lambda x: x["requests"][0].__setitem__(
            "num_computed_tokens", len(r0["token_ids"]) + 5)),
        "prompt longer than tokens": variant(lambda x: x["requests"][0].__setitem__(
            "num_prompt_tokens", len(r0["token_ids"]) + 1)),
        "too few blocks": variant(lambda x: x["requests"][0].__setitem__(
            "block_ids", r0["block_ids"][:1])),
        "token outside the vocabulary": variant(
            lambda x: x["requests"][0]["token_ids"].__setitem__(0, 10 ** 6)),
        "wrong type": variant(lambda x: x["requests"][0].__setitem__("token_ids", "abc")),
        "missing field": variant(lambda x: x["requests"][0].pop("block_ids")),
        "too many requests": variant(lambda x: x.__setitem__(
            "requests", [dict(r0, request_id=f"x{i}", block_ids=[],
                              num_computed_tokens=0, num_cached_blocks=0)
                         for i in range(5000)])),
        "duplicate request": variant(lambda x: x["requests"].append(x["requests"][0])),
        "parent not an entry": variant(
            lambda x: x["entries"][-1].__setitem__(3, 10 ** 9)),
        "chunk listed twice": variant(lambda x: x["chunks"].append(x["chunks"][0])),
        "bad sampling params": variant(
            lambda x: x["requests"][0]["params"].__setitem__("max_tokens", -1)),
    }


def test_a_bad_handover_is_refused_whole_and_a_good_one_still_claims(
        start_daemon, tiny_dir, uninterrupted):
    d = start_daemon(budget="8MiB")
    old = spawn_warm(d, tiny_dir, "old")
    start_mid_generation(old)
    new = spawn_warm(d, tiny_dir, "new")
    send(old, cmd="export", to="new", ttl=60)
    c = read_event(old, "cache")["cache"]
    for why, bad in _broken(c).items():
        send(new, cmd="import", cache=bad)
        got = read_event(new, "refused")
        assert "bad handover" in got["error"], (why, got)
        assert "\n" not in got["error"], why
        assert (got["used"], got["requests"]) == (0, 0), f"{why}: something stayed"
    send(new, cmd="import", cache=c)  # the ticket was left for the real message
    read_event(new, "adopted")
    assert settled_of(old)["state"] == "claimed"
    assert read_event(new, "done", timeout=120)["tokens"] == uninterrupted
    assert d.check() == []
