"""A real daemon with one injected bug, for the fault-isolation tests.

    python tests/daemon/faulty_daemon.py FAULT TRIGGER_FILE <kvpool daemon args...>

FAULT ``read``: reading the fd channel of a tenant named ``boom`` raises (a handler bug
confined to one tenant). FAULT ``crash``: once TRIGGER_FILE exists, the loop itself
raises (a bug outside any tenant's handling: the daemon ends, with its restart state).
FAULT ``step``: once TRIGGER_FILE exists, device 1's reclaim step raises after it has
taken the waiters it serves or fails (a bug in one device's tick, e.g. its policy).
FAULT ``serve``: once TRIGGER_FILE exists, serving a waiting grant of device 1 raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvpool.daemon import fdsessions, grants, reclaim, server  # noqa: E402


def inject(fault: str, trigger: Path) -> None:
    if fault == "read":
        real_read = fdsessions.FdSessions.read

        def read(self, t):
            if t.name == "boom":
                raise RuntimeError("injected fault while reading boom's fd channel")
            return real_read(self, t)

        fdsessions.FdSessions.read = read
    elif fault == "crash":
        real_turn = server.Server.turn

        def turn(self):
            if trigger.exists():
                raise RuntimeError("injected fault in the loop")
            return real_turn(self)

        server.Server.turn = turn
    elif fault == "step":
        real_step = reclaim.Reclaimer.step

        def step(self, now):
            done = real_step(self, now)
            if trigger.exists() and self.pool.backend.device == 1:
                raise RuntimeError("injected fault in device 1's reclaim step")
            return done

        reclaim.Reclaimer.step = step
    elif fault == "serve":
        real_serve = grants.Grants.serve

        def serve(self, w):
            if trigger.exists() and self.pool.backend.device == 1:
                raise RuntimeError("injected fault serving a waiter of device 1")
            return real_serve(self, w)

        grants.Grants.serve = serve
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    inject(sys.argv[1], Path(sys.argv[2]))
    from kvpool.cli.main import cli

    cli(sys.argv[3:], prog_name="kvpool")
