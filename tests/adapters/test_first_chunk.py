"""A server whose first KV chunk is refused waits for memory instead of exiting (issue 33,
item 6: ``expected the allocator's first block to be 0, got []``; a fleet member started
on demand under pressure died and its model was ``failed`` for 10 s).

A real daemon (64 KiB pages, 4 MiB) whose whole budget a hog holds when an elastic
``kvpool serve`` starts; the daemon refuses the server's first grant (NO_MEMORY after its
1 s reclaim deadline: the hog gives nothing back), the server says it waits, the hog lets
go, and the server comes up and serves."""

from __future__ import annotations

from daemon.helpers import PAGE, wait_for

from .serve_procs import complete, prompt

BUDGET = 64 * PAGE
DEADLINE_S = 120.0
WAITING = "no memory for the KV cache's first chunk yet"


def test_a_refused_first_chunk_waits_for_memory(start_daemon, servers):
    d = start_daemon(budget=str(BUDGET), extra=("--reclaim-timeout", "1", "--warm-max", "0"))
    with d.connect("hog", timeout_s=60) as hog:
        g = hog.region_group(1, BUDGET)
        g.grant(range(BUDGET // PAGE))  # the whole budget, given back to nobody
        hog.report_state("busy")
        late = servers.start("late", run_dir=d.run_dir, weights="local")
        wait_for(lambda: WAITING in late.logs() or late.proc.poll() is not None,
                 DEADLINE_S, 0.1, "the server refused its first chunk")
        assert late.proc.poll() is None, late.logs()  # it waits; it did not exit
        g.release(sorted(g.mapped))
    servers.wait_healthy(timeout=DEADLINE_S)
    r = complete(late.base, prompt(3), 8, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    assert "Traceback" not in late.logs()
    assert d.check() == []


def test_a_first_chunk_over_the_tenants_max_fails_at_once_in_one_line(start_daemon,
                                                                      servers):
    """No amount of waiting makes a chunk fit under the tenant's own max: the server
    exits with one line, not after the wait."""
    d = start_daemon(budget=str(BUDGET), extra=("--reclaim-timeout", "1",))
    bad = servers.start("small", run_dir=d.run_dir, weights="local",
                        env={"KVPOOL_MAX": str(PAGE // 2)})
    assert bad.proc.wait(DEADLINE_S) == 1, bad.logs()
    text = bad.logs()
    assert "Traceback" not in text and WAITING not in text, text
    assert "first chunk" in text and "OVER_LIMIT" in text, text
    assert len(text.strip().splitlines()) == 1, text
