"""Issue 34 item 5: every memory move a user would ask about is an event with its cause,
in ``kvpool events``: grants and releases, sleeps and wakes with their reason (operator,
pressure, the tenant's own: idle, request), a pressure sleep's victim and what it freed
(in the reclaim round too, never "asked [nobody], answered [nothing]"), weight sets
created, sealed, attached, detached and evicted; and ``top`` shows grants."""

from __future__ import annotations

import json
import threading

from daemon.helpers import PAGE, wait_for
from kvpool.client_lib.weights import WeightSet

BUDGET = 16  # pages


def events(d, *args: str) -> list[dict]:
    return [json.loads(x) for x in d.cli("events", "--json", *args).stdout.splitlines()]


class Releaser:
    """A sleep handler that releases every unit of ``group``, and maybe a weight set."""

    def __init__(self, group, ws=None):
        self.group, self.ws = group, ws
        self.done = threading.Event()

    def sleep(self, reason: str) -> bool:
        self.group.release(sorted(self.group.mapped))
        if self.ws is not None:
            self.ws.detach()
        self.done.set()
        return True

    def wake(self, reason: str) -> bool:
        return True


def test_operator_sleep_and_wake_are_events_with_their_reason(daemon):
    with daemon.connect("srv", timeout_s=30) as srv:
        g = srv.region_group(1, 8 * PAGE)
        g.grant(range(4))
        srv.set_sleep_handler(Releaser(g))
        srv.report_state("idle")
        daemon.cli("sleep", "srv", "--wait", "60")
        daemon.cli("wake", "srv", "--wait", "60")
        evs = [e for e in events(daemon, "--tenant", "srv")]
        kinds = [e["kind"] for e in evs]
        assert kinds.count("grant") == 1 and kinds.count("release") == 1, evs
        (rel,) = [e for e in evs if e["kind"] == "release"]
        assert rel["bytes"] == 4 * PAGE
        asks = [e for e in evs if e["kind"] == "ask"]
        assert [(a["detail"]["mode"], a["detail"]["reason"]) for a in asks] == [
            ("sleep", "operator"), ("wake", "operator")]
        assert asks[0]["bytes"] == 4 * PAGE  # what it held when asked
        (slept,) = [e for e in evs if e["kind"] == "sleep"]
        assert slept["detail"]["reason"] == "operator" and slept["bytes"] == 4 * PAGE
        (woke,) = [e for e in evs if e["kind"] == "wake"]
        assert woke["detail"]["reason"] == "operator"
        assert kinds.index("release") < kinds.index("sleep") < kinds.index("wake")
        text = daemon.cli("events", "--tenant", "srv").stdout
        assert any(" sleep " in line and "reason=operator" in line for line in text.splitlines())
        # a sleep of its own (the engine's idle timer), a wake for a request
        g.grant(range(2))
        g.release(sorted(g.mapped))
        srv.report_state("asleep", "idle")
        srv.report_state("idle", "request")
        own = [e for e in events(daemon, "--tenant", "srv") if e["kind"] in ("sleep", "wake")]
        assert [(e["kind"], e["detail"]["reason"]) for e in own][-2:] == [
            ("sleep", "idle"), ("wake", "request")]
        assert own[-2]["bytes"] == 0  # it held nothing more at its last report
    assert daemon.check() == []


def test_a_pressure_sleep_names_its_victim_and_what_it_freed(start_daemon):
    """16 pages; x (idle, sleepable) holds 6 KV pages and a 6-page weight set and frees
    them only in its sleep handler; y asks for 14 (more than x's KV: the set must go
    too): x is put to sleep, its set evicted, and the round and the sleep event say so."""
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--reclaim-timeout", "30",
                                                      "--warm-max", "0"))
    with d.connect("x", timeout_s=60, sleepable=True) as x, \
            d.connect("y", timeout_s=60) as y, d.connect("z", timeout_s=60) as z:
        ws = WeightSet.create(x, "ab" * 32, 6 * PAGE)
        ws.seal()
        other = WeightSet.attach(z, "ab" * 32)
        other.detach()
        gx = x.region_group(1, BUDGET * PAGE)
        gx.grant(range(6))
        handler = Releaser(gx, ws)
        x.set_sleep_handler(handler)
        x.report_state("idle")
        gy = y.region_group(1, BUDGET * PAGE)
        gy.grant(range(14))
        assert wait_for(lambda: any(e["kind"] == "sleep" for e in events(d, "--tenant", "x")),
                        what="x's sleep event")
        evs = events(d)
    rounds = [e for e in evs if e["kind"] == "reclaim"]
    assert len(rounds) == 1, evs
    r = rounds[0]["detail"]
    assert r["slept"] == {"x": 12 * PAGE}  # the victim, and what it held when asked
    assert r["answered"].get("x") == 12 * PAGE  # its KV released, its set let go
    assert r["evicted"] == 6 * PAGE and "x" in r["tenants"]
    (slept,) = [e for e in evs if e["kind"] == "sleep"]
    assert slept["tenant"] == "x" and slept["detail"]["reason"] == "pressure"
    assert slept["bytes"] == 12 * PAGE
    (ask,) = [e for e in evs if e["kind"] == "ask" and e["detail"]["mode"] == "sleep"]
    assert ask["tenant"] == "x" and ask["detail"]["reason"] == "pressure"
    ops = [(e["detail"]["op"], e["tenant"]) for e in evs if e["kind"] == "weights"]
    assert ops == [("create", "x"), ("seal", "x"), ("attach", "z"), ("detach", "z"),
                   ("detach", "x"), ("evict", "")], ops
    assert all(e["bytes"] == 6 * PAGE for e in evs if e["kind"] == "weights")
    text = d.cli("events").stdout
    line = next(ln for ln in text.splitlines() if " reclaim " in ln)
    assert "put to sleep [x 768 KiB]" in line and "asked [nobody]" not in line, line


def test_top_shows_grants_and_releases(daemon):
    with daemon.connect("busy") as t:
        g = t.region_group(1, 8 * PAGE)
        for u in range(3):
            g.grant([u])
        g.release([0])
        out = daemon.cli("top", "--once").stdout
    assert "(no events yet)" not in out, out
    shown = out.split("last events:")[1]
    grant = next(ln for ln in shown.splitlines() if " grant " in ln)
    assert "busy" in grant and "x=3" in grant and "192 KiB" in grant, shown
    assert any(" release " in ln and "busy" in ln for ln in shown.splitlines()), shown


def test_a_sleep_answering_the_daemons_ask_takes_its_reason_from_the_ask(daemon):
    """A tenant that reports ``asleep`` without saying why, after the operator asked it
    to sleep: the daemon names the operator (its own ask), not the tenant."""
    import subprocess
    import sys

    from daemon.helpers import REPO

    with daemon.connect("quiet", timeout_s=30) as quiet:  # no sleep handler: it says itself
        quiet.report_state("idle")
        cli = subprocess.Popen([sys.executable, "-m", "kvpool.cli.main", "sleep", "quiet",
                                "--wait", "60", "--run-dir", str(daemon.run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=REPO)
        daemon.workers.append(cli)
        wait_for(lambda: any(e["kind"] == "ask" for e in events(daemon, "--tenant", "quiet")),
                 what="the operator's ask")
        quiet.report_state("asleep")
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0 and out.strip() == "quiet: asleep", (out, err)
        (slept,) = [e for e in events(daemon, "--tenant", "quiet") if e["kind"] == "sleep"]
        assert slept["detail"]["reason"] == "operator"
        quiet.report_state("idle")  # a wake nobody asked for, without a word: its own
        (woke,) = [e for e in events(daemon, "--tenant", "quiet") if e["kind"] == "wake"]
        assert woke["detail"]["reason"] == "tenant"
