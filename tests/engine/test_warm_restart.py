"""Warm restart with real processes: an idle engine hands its prefix cache to a new
engine process as pages; the new one serves the repeated prompts with prefix-cache hits
and the same tokens, the very same pages changed tenant, the memory is accounted once
(moved, not added), and an unclaimed offer leaves the old engine as it was."""

from __future__ import annotations

import subprocess
import sys
import os

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import REPO, read_event

from .test_pd_handoff import GREEDY, KV, WORKER, pages, prompt, send, tenants

LENGTHS = [70, 130, 200]


def spawn(d, model, name: str) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--model", str(model), "--run-dir", str(d.run_dir),
           "--name", name, "--kv", KV, "--no-aligned"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    d.workers.append(proc)
    read_event(proc, "ready", timeout=120)
    return proc


def run(proc, n: int, rid: str) -> dict:
    send(proc, cmd="run", id=rid, prompt=prompt(n), params=GREEDY)
    return read_event(proc, "done")


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
    settled = read_event(old, "settled")
    assert settled["state"] == "claimed"
    given = cache["units"]
    assert not set(given) & set(settled["mapped"]) and not set(given) & set(pages(d, "old"))
    # the very same pages, now the new tenant's, and none created for it
    after_new = pages(d, "new")
    moved = sorted(map(tuple, (after_new[u] for u in after_new if u not in before_new)))
    assert moved == sorted(map(tuple, (before_old[u] for u in given)))
    assert d.stats().pool.granted == granted
    now = tenants(d)
    page = d.page_size
    assert now["old"]["mapped"] == held["old"]["mapped"] - len(given) * page
    assert now["new"]["mapped"] == held["new"]["mapped"] + len(given) * page
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
    settled = read_event(old, "settled")
    assert settled["state"] == "expired"
    assert set(cache["units"]) <= set(settled["mapped"])
    again = run(old, 130, "b")
    assert again["hit"] > 0 and again["tokens"] == first["tokens"]
    send(old, cmd="check")
    assert read_event(old, "ok")["used"] == 0
    assert d.check() == []
