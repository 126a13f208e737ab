"""``kvpool events``: during a lease that forces a reclaim, one complete reclaim round
whose per-tenant asks and answers add up to the bytes granted; ``--tenant`` filters;
``--follow`` delivers the round as it happens (the daemon's long poll)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from daemon.helpers import REPO, read_line

from . import scenario


def lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.strip()]


def test_a_lease_shows_one_complete_reclaim_round(start_daemon):
    d, _ = scenario.start(start_daemon, metrics=False)
    job, nbytes, free = scenario.force_reclaim(d)
    evs = lines(d.cli("events", "--json").stdout)
    rounds = [e for e in evs if e["kind"] == "reclaim"]
    assert len(rounds) == 1, rounds
    r = rounds[0]["detail"]
    assert rounds[0]["bytes"] == nbytes  # granted to the waiting lease
    assert r["served"] == 1 and r["failed"] == 0 and r["free_at_start"] == free
    asked, answered = r["asked"], r["answered"]
    assert set(asked) <= {"alpha", "beta"} and asked
    assert set(answered) == set(asked)  # every tenant asked answered
    assert sum(asked.values()) == nbytes - free  # the asks cover exactly what was missing
    assert sum(answered.values()) == sum(asked.values())
    assert free + sum(answered.values()) == rounds[0]["bytes"]
    asks = [e for e in evs if e["kind"] == "ask"]
    assert {e["tenant"] for e in asks} == set(asked)
    assert sum(e["bytes"] for e in asks) == sum(asked.values())
    kinds = [e["kind"] for e in evs]
    assert kinds.index("wait") < kinds.index("ask") < kinds.index("reclaim")
    assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)
    lease = [e for e in evs if e["kind"] == "lease"]
    assert lease and lease[-1]["bytes"] == nbytes and lease[-1]["detail"]["waited_s"] > 0

    alpha = lines(d.cli("events", "--json", "--tenant", "alpha").stdout)
    assert alpha and all(e["tenant"] == "alpha" or "alpha" in e["detail"].get("tenants", ())
                         for e in alpha)
    assert any(e["kind"] == "grant" for e in alpha)
    assert not any(e["tenant"] == "beta" for e in alpha)
    text = d.cli("events").stdout
    assert "reclaim" in text and "round of" in text
    job.close()


def test_follow_delivers_the_round_as_it_happens(start_daemon):
    d, _ = scenario.start(start_daemon, metrics=False)
    since = max(e["seq"] for e in lines(d.cli("events", "--json").stdout))
    follow = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "events", "--follow", "--json", "--since",
         str(since), "--run-dir", str(d.run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    d.workers.append(follow)
    # no wait for it to park first: --since makes it deliver every later event, whether
    # it asks before or after they happen
    job, nbytes, _ = scenario.force_reclaim(d)
    seen = []
    deadline = time.monotonic() + 30
    while not any(e["kind"] == "reclaim" for e in seen):
        line = read_line(follow, max(0.0, deadline - time.monotonic()))
        assert line is not None, (seen, follow.stderr.read())
        seen.append(json.loads(line))
    assert seen[0]["seq"] == since + 1  # nothing skipped, nothing repeated
    assert [e["seq"] for e in seen] == list(range(since + 1, since + 1 + len(seen)))
    assert [e for e in seen if e["kind"] == "reclaim"][0]["bytes"] == nbytes
    follow.terminate()
    follow.wait(10)
    job.close()


def test_a_limit_change_and_a_death_are_events(start_daemon):
    d, _ = scenario.start(start_daemon, metrics=False)
    held = {t["name"]: t["mapped"] for t in d.cli_json("ps")["tenants"]}
    d.cli("limit", "beta", "1MiB", "--shares", "2")
    victim = d.workers[0]  # alpha
    victim.kill()
    victim.wait()
    deadline = time.monotonic() + 30
    while True:
        evs = lines(d.cli("events", "--json").stdout)
        deaths = [e for e in evs if e["kind"] == "death"]
        if deaths:
            break
        assert time.monotonic() < deadline, evs
        time.sleep(0.05)
    (death,) = deaths
    assert death["tenant"] == "alpha" and death["bytes"] == held["alpha"]
    assert death["detail"]["reason"]
    (limit,) = [e for e in evs if e["kind"] == "limit"]
    assert limit["detail"]["max"] == 1 << 20 and limit["detail"]["shares"] == 2
    assert limit["detail"]["tenants"] == ["beta"]
    beta = lines(d.cli("events", "--json", "--tenant", "beta").stdout)
    assert limit in beta and death not in beta
