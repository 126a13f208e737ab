"""Sleep and wake of elastic bundled servers (issue 22, point 4): real ``kvpool serve
--elastic`` processes of the tiny model on one real daemon (64 KiB pages, 4 MiB).

* by HTTP (``POST /sleep``, ``GET /is_sleeping``, ``POST /wake_up``) and by CLI
  (``kvpool sleep/wake NAME``): asleep, the tenant holds 0 bytes (``ps --json``: mapped 0,
  weights 0); a request to a sleeping server wakes it and is served; the first request
  after waking gives the same greedy tokens as before sleeping; a sleep while requests
  run is refused (409); a bad level is a 400;
* ``--sleep-after`` (``KVPOOL_SLEEP_AFTER``) puts an idle server to sleep;
* daemon-initiated: a needy tenant's grant that needs an idle sleepable server's memory
  goes through (that server is put to sleep, then serves again), while an idle server
  that did not opt in is never put to sleep (the grant gets NO_MEMORY).

Outcomes are waited for with generous deadlines (ps states), never timed.
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvpool import protocol as p
from kvpool.client_lib import KvpoolError

from daemon.helpers import PAGE, wait_for

from .serve_procs import Servers, complete, prompt

BUDGET = 64 * PAGE  # 4 MiB
DEADLINE_S = 120.0
PROMPT = prompt(7)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def daemon():
    """One daemon for the module: a short reclaim deadline (the NO_MEMORY outcome waits
    it out), no warm pages (released pages are free at once)."""
    from daemon.helpers import daemon_command, spawn_daemon, stop_daemon, wait_ready

    run_dir = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))  # short socket paths
    cmd = daemon_command(run_dir, "--reclaim-timeout", "5", "--warm-max", "0",
                         budget=str(BUDGET), page_size=PAGE)
    d = spawn_daemon(cmd, run_dir, run_dir.with_suffix(".log"), PAGE, None, wait=False)
    try:
        wait_ready(d)
        yield d
    finally:
        stop_daemon(d)
        shutil.rmtree(run_dir, ignore_errors=True)
        d.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def fleet(daemon, tiny_model, tmp_path_factory):
    """plain: elastic, not sleepable; lazy: sleeps after 1 s idle; willing: sleepable."""
    s = Servers(tiny_model, tmp_path_factory.mktemp("logs"))
    try:
        # weights in the pool (the CLI's default): one set, shared by the three
        plain = s.start("plain", run_dir=daemon.run_dir, weights=None)
        lazy = s.start("lazy", run_dir=daemon.run_dir, extra=("--sleep-after", "1"),
                       weights=None)
        willing = s.start("willing", run_dir=daemon.run_dir, extra=("--sleepable",),
                          weights=None)
        s.wait_healthy(timeout=DEADLINE_S)
        yield plain, lazy, willing
    finally:
        s.close()


def ps(daemon, name: str) -> dict:
    rows = [t for t in daemon.cli_json("ps")["tenants"] if t["name"] == name]
    assert len(rows) == 1, rows
    return rows[0]


def state(daemon, name: str) -> str:
    with daemon.monitor() as m:
        return next(t.state for t in m.ps().tenants if t.name == name)


def tokens(base: str) -> list[int]:
    r = complete(base, PROMPT, MAX_TOKENS, timeout=DEADLINE_S, return_token_ids=True)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def holds_nothing(daemon, name: str) -> None:
    row = ps(daemon, name)
    assert (row["state"], row["mapped"], row["weights"]) == ("asleep", 0, 0), row


def test_sleep_and_wake_by_http_and_cli(daemon, fleet):
    plain, _, _ = fleet
    before = tokens(plain.base)
    row = ps(daemon, "plain")
    assert row["mapped"] > 0 and row["weights"] > 0, row  # KV and its weight set
    assert httpx.get(f"{plain.base}/is_sleeping").json() == {"is_sleeping": False}
    r = httpx.post(f"{plain.base}/sleep", timeout=DEADLINE_S)
    assert (r.status_code, r.json()) == (200, {"status": "sleeping", "level": 1})
    assert httpx.get(f"{plain.base}/is_sleeping").json() == {"is_sleeping": True}
    holds_nothing(daemon, "plain")
    r = httpx.post(f"{plain.base}/wake_up", timeout=DEADLINE_S)
    assert (r.status_code, r.json()) == (200, {"status": "awake", "tags": None})
    assert httpx.get(f"{plain.base}/is_sleeping").json() == {"is_sleeping": False}
    assert tokens(plain.base) == before  # the first request after waking

    out = daemon.cli("sleep", "plain", "--wait", "25")
    assert out.stdout.strip() == "plain: asleep", out
    holds_nothing(daemon, "plain")
    out = daemon.cli("wake", "plain", "--wait", "25")
    assert out.stdout.strip() == "plain: awake", out
    assert state(daemon, "plain") != "asleep"
    assert tokens(plain.base) == before

    # a request to a sleeping server wakes it and is served, same tokens
    assert httpx.post(f"{plain.base}/sleep", timeout=DEADLINE_S).status_code == 200
    holds_nothing(daemon, "plain")
    assert tokens(plain.base) == before
    assert httpx.get(f"{plain.base}/is_sleeping").json() == {"is_sleeping": False}
    daemon.cli("sleep", "plain", "--wait", "25")
    holds_nothing(daemon, "plain")
    r = httpx.post(f"{plain.base}/v1/completions", timeout=DEADLINE_S, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert "error" not in r.text

    # bad input: one line, a 4xx
    r = httpx.post(f"{plain.base}/sleep?level=7", timeout=DEADLINE_S)
    assert r.status_code == 400 and "level" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{plain.base}/sleep?mode=nap", timeout=DEADLINE_S)
    assert r.status_code == 400, r.text


def test_a_sleep_while_requests_run_is_refused(daemon, fleet):
    """A request that cannot get its KV is running work until it can: plain's limit is
    lowered to one page (below the KV a 400-token prompt needs), so the request waits in
    the engine, and stays there until the limit goes back up — however slow or fast the
    machine. Meanwhile a sleep by HTTP (409) and by CLI (one line, nonzero) is refused;
    with the limit raised the request is served and plain goes idle."""
    plain, _, _ = fleet
    assert daemon.cli("limit", "plain", "64KiB").returncode == 0
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, plain.base, prompt(11, n=400), 8, timeout=DEADLINE_S)
        try:
            wait_for(lambda: state(daemon, "plain") == "busy", DEADLINE_S, 0.05,
                     "plain busy")
            r = httpx.post(f"{plain.base}/sleep", timeout=DEADLINE_S)
            assert r.status_code == 409, r.text
            assert "serving requests" in r.json()["error"]["message"]
            out = daemon.cli("sleep", "plain", "--wait", "1", check=False)
            assert out.returncode != 0 and len(out.stderr.splitlines()) == 1, out
            assert "Traceback" not in out.stderr
            assert state(daemon, "plain") == "busy"
        finally:
            daemon.cli("limit", "plain", "100%")
        r = fut.result()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    wait_for(lambda: state(daemon, "plain") == "idle", DEADLINE_S, 0.05, "plain idle")


def test_sleep_after_puts_an_idle_server_to_sleep(daemon, fleet):
    _, lazy, _ = fleet
    wait_for(lambda: state(daemon, "lazy") == "asleep", DEADLINE_S, 0.1, "lazy asleep")
    holds_nothing(daemon, "lazy")
    first = tokens(lazy.base)  # woken by the request, served
    wait_for(lambda: state(daemon, "lazy") == "asleep", DEADLINE_S, 0.1, "lazy asleep again")
    holds_nothing(daemon, "lazy")
    assert tokens(lazy.base) == first


def test_pressure_sleeps_only_the_sleepable_idle_server(daemon, fleet):
    """A needy tenant of 10000 shares (every idle server is above its fair share: less than a
    page) asks for the free pages and willing's: no shrink gives an idle server's last chunk back,
    so the grant goes through only by putting willing (sleepable) to sleep. Asking for
    plain's pages too ends NO_MEMORY: plain did not opt in and is never put to sleep."""
    plain, lazy, willing = fleet
    wait_for(lambda: state(daemon, "lazy") == "asleep", DEADLINE_S, 0.1, "lazy asleep")
    reference = tokens(willing.base)

    def settled() -> bool:  # idle, reserves drained: what each holds no shrink frees
        rows = {t["name"]: t for t in daemon.cli_json("ps")["tenants"]}
        return all(rows[n]["state"] == "idle" and rows[n]["reserve"] == 0
                   and rows[n]["mapped"] > 0 for n in ("plain", "willing"))

    wait_for(settled, DEADLINE_S, 0.1, "plain and willing idle with no reserve")
    with daemon.connect("needy", timeout_s=DEADLINE_S, shares=10000.0) as needy:
        needy.report_state("busy")
        g = needy.region_group(1, BUDGET)
        # everything but the shared weight set and plain's last page (lazy is asleep):
        # free pages and shrinks cannot make it up, only willing's sleep (counted from
        # the budget, not from a snapshot of free pages that a late release can grow)
        weights = daemon.cli_json("ps")["pool"]["weights"] // PAGE
        want = BUDGET // PAGE - weights - 1
        g.grant(range(want))  # goes through: willing was put to sleep
        holds_nothing(daemon, "willing")
        plain_pages = ps(daemon, "plain")["mapped"] // PAGE
        assert ps(daemon, "plain")["state"] == "idle" and plain_pages > 0
        with pytest.raises(KvpoolError) as e:  # only plain's pages are left: refused
            g.grant(range(want, want + plain_pages))
        assert e.value.code == p.NO_MEMORY, e.value
        assert ps(daemon, "plain")["state"] == "idle" and ps(daemon, "plain")["mapped"] > 0
        g.release(sorted(g.mapped))
    assert tokens(willing.base) == reference  # woken by the request
    assert daemon.check() == []
