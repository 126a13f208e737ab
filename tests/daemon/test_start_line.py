"""Issue 34 item 7: the daemon's start line gives the warm pool's bounds in the unit the
operator set them in (a size, like the budget beside it), not in pages; ``ps --json``
reports the same bounds in bytes."""

from __future__ import annotations

from .helpers import PAGE, wait_for


def test_start_line_gives_warm_bounds_as_sizes(start_daemon):
    d = start_daemon(extra=("--warm-min", "128KiB", "--warm-max", "1MiB"))
    line = wait_for(lambda: next((x for x in d.logs().splitlines() if " serving " in x), None),
                    what="the daemon's start line")
    assert "page 64 KiB, budget 8 MiB (128 pages), warm 128 KiB..1 MiB" in line, line
    pool = d.cli_json("ps")["pool"]
    assert (pool["warm_min"], pool["warm_max"]) == (2 * PAGE, 16 * PAGE)
