"""The live view of a demo run: requests done and failed, and memory, per model."""

from __future__ import annotations

import time
from typing import Any, Sequence

from rich.table import Table

from kvpool.demo.driver import Outcome
from kvpool.demo.workload import Arrival
from kvpool.sizes import format_size


class Progress:
    """Counts each finished request (:meth:`done`); the caller sets ``memory`` (bytes per
    model) from its samples; :meth:`render` is the table a ``rich.live.Live`` shows."""

    def __init__(self, mode: str, arrivals: list[Arrival], models: Sequence[str],
                 memory_label: str = "KV memory") -> None:
        self.mode = mode
        self.memory_label = memory_label
        self.total = {m: sum(1 for a in arrivals if a.model == m) for m in models}
        self.finished = {m: 0 for m in models}
        self.errors = {m: 0 for m in models}
        self.memory: dict[str, Any] = {}
        self.start = time.perf_counter()

    def done(self, o: Outcome) -> None:
        (self.errors if o.error else self.finished)[o.model] += 1

    def render(self) -> Table:
        t = Table(title=f"{self.mode}: {time.perf_counter() - self.start:.0f} s")
        for col in ("model", "done", "errors", self.memory_label):
            t.add_column(col, justify="left" if col == "model" else "right")
        for m in self.total:
            t.add_row(m, f"{self.finished[m]}/{self.total[m]}", str(self.errors[m]),
                      format_size(self.memory.get(m, 0)))
        return t
