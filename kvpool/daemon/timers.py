"""The loop's timers: when the next one is due, and what each does when it is.

* reclaim deadlines and the end of recovery (``Arbiter.next_deadline``): a tick;
* fd sockets full for ``send_timeout_s``: the tenant is dropped; parked Adopts past
  ``adopt_wait_s``: refused;
* restart state changed: ``state.json`` saved;
* every ``liveness_s``: tenants whose pid is gone (no pidfd) or that never registered
  are dropped, and retained pages rechecked (waiting grants may fit after);
* the systemd watchdog, and a status line every ``status_interval_s``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.daemon.server import Server

NO_WATCHDOG_S = 3600.0  # how often the watchdog timer wakes when systemd set none


class Timers:
    def __init__(self, server: Server):
        self.server = server
        self.next_liveness = 0.0
        self.next_watchdog = 0.0
        self.next_status = 0.0

    def next_due(self) -> float:
        """The monotonic time the loop must wake at, at the latest."""
        s = self.server
        times = [self.next_liveness, self.next_watchdog, self.next_status]
        stuck = s.fdsend.next_deadline(s.cfg.send_timeout_s)
        parked = s.sessions.next_deadline()
        times += [x for x in (stuck, parked) if x is not None]
        t = min(times)
        d = s.arbiter.next_deadline()
        return min(t, d + 0.001) if d is not None else t

    def run(self) -> None:
        """Whatever is due now."""
        s = self.server
        now = time.monotonic()
        d = s.arbiter.next_deadline()
        if d is not None and now >= d:
            s.tick()
        s.fdsend.expire(now)
        s.sessions.expire(now)
        s.save_state_if_changed()
        if now >= self.next_liveness:
            self.next_liveness = now + s.cfg.liveness_s
            s.sessions.check_liveness(now)
            if s.pool.recheck_retained():  # released pages a tenant kept, now gone
                s.tick_soon()  # waiting grants may fit now
        if now >= self.next_watchdog:
            interval = s.notifier.watchdog_interval
            self.next_watchdog = now + (interval or NO_WATCHDOG_S)
            if interval:
                s.notifier.watchdog()
        if now >= self.next_status:
            self.next_status = now + s.cfg.status_interval_s
            s.notifier.status(s.status_line())
