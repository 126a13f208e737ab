"""A fork server of victim tenants for the kill storm (tests/daemon/test_kill_storm.py).

It imports the client library once, then for every ``go NAME UNITS FILL`` line on stdin
forks a child that connects as ``NAME``, grants ``UNITS`` units of one region, counts the
bytes that are not zero in what it was given (a page that changes tenant must arrive
zeroed), fills it all with ``FILL`` and prints one JSON line
``{"event": "ready", "pid": ..., "nonzero": ..., "pages": ...}``, then sleeps until it is
killed. A child that fails prints ``{"event": "error", ...}``. Children are reaped by
the kernel (SIGCHLD ignored); the server exits at EOF on stdin.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback


def emit(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def victim(run_dir: str, name: str, units: int, fill: int) -> None:
    from kvpool.client_lib import NoMemory, connect

    t = connect(name=name, run_dir=run_dir)
    g = t.region_group(1, units * t.page_size)
    deadline = time.monotonic() + 30
    while True:  # the dead victim's pages may still be on their way back
        try:
            g.grant(range(units))
            break
        except NoMemory:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    size = units * t.page_size
    data = ctypes.string_at(g.ranges[0].base, size)
    nonzero = size - data.count(0)
    ctypes.memset(g.ranges[0].base, fill, size)
    emit(event="ready", pid=os.getpid(), nonzero=nonzero, pages=units)
    while True:
        time.sleep(60)


def main() -> None:
    run_dir = sys.argv[1]
    import kvpool.client_lib  # noqa: F401  (imported once, before any fork)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        word, name, units, fill = line.split()
        assert word == "go"
        if os.fork() == 0:
            try:
                victim(run_dir, name, int(units), int(fill, 0))
            except BaseException as e:  # noqa: BLE001 - report, never fall back into the loop
                emit(event="error", error=f"{type(e).__name__}: {e}",
                     trace=traceback.format_exc())
            finally:
                os._exit(1)


if __name__ == "__main__":
    main()
