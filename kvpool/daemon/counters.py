"""The daemon's request counters: requests received and error answers, since start.

One :class:`Counters` per daemon, shared by whoever answers requests (the arbiter, its
grant paths, the control socket, the loop's guard) and read by ``stats`` and the
observer's snapshot. Loop thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Counters:
    requests: int = 0  # control requests received (decoded or refused before decoding)
    errors: int = 0  # error answers of any kind
    started: float = field(default_factory=time.monotonic)  # monotonic start time

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started
