"""Issue 34 item 7: a monitor session (every ``kvpool ps``, each ``top`` frame, ``check``,
``events``) holds no memory, so its register and drop are DEBUG lines in the daemon log,
not INFO: one fleet run's log was 54 of 76 lines of them. A tenant's are still INFO."""

from __future__ import annotations

import re

from daemon.helpers import wait_for

LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) kvpool\.daemon: tenant (?P<id>\d+) "
                  r"(?P<what>registered: \S+ \((?P<kind>\w+)\)|\(.*\) dropped)")


def session_lines(log: str) -> dict[str, list[tuple[str, str]]]:
    """Each session id's (level, kind-or-'dropped') lines, in order."""
    out: dict[str, list[tuple[str, str]]] = {}
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            out.setdefault(m["id"], []).append((m["level"], m["kind"] or "dropped"))
    return out


def test_monitor_sessions_log_at_debug_and_tenants_at_info(start_daemon):
    d = start_daemon(extra=("--log-level", "DEBUG"))
    for _ in range(3):
        d.cli("ps")
    d.cli("check")
    with d.connect("worker") as t:
        t.region_group(1, 2 * d.page_size).grant([0])

    def all_dropped():
        seen = session_lines(d.logs())
        done = [s for s in seen.values() if len(s) == 2]
        return seen if len(done) == 5 else None

    seen = wait_for(all_dropped, timeout=60, what="five sessions registered and dropped")
    monitors = [s for s in seen.values() if s[0][1] == "monitor"]
    tenants = [s for s in seen.values() if s[0][1] != "monitor"]
    assert len(monitors) == 4 and len(tenants) == 1, seen
    assert all(level == "DEBUG" for s in monitors for level, _ in s), seen
    assert all(level == "INFO" for s in tenants for level, _ in s), seen
