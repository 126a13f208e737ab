"""The live view of a demo run: requests done and failed, and memory, per model."""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table

from kvpool.demo.driver import Outcome
from kvpool.demo.workload import Arrival
from kvpool.sizes import format_size


class Progress:
    """Counts each finished request (:meth:`done`); the caller sets ``memory`` (bytes per
    model) from its samples and calls :meth:`show`; :meth:`render` is the table the live
    view of :meth:`watch` shows."""

    def __init__(self, mode: str, arrivals: list[Arrival], models: Sequence[str],
                 memory_label: str = "KV memory") -> None:
        self.mode = mode
        self.memory_label = memory_label
        self.total = {m: sum(1 for a in arrivals if a.model == m) for m in models}
        self.finished = {m: 0 for m in models}
        self.errors = {m: 0 for m in models}
        self.memory: dict[str, Any] = {}
        self.start = time.perf_counter()
        self._live: Live | None = None

    def watch(self, console: Console, enabled: bool) -> ContextManager[Any]:
        """The live view while the block runs (``enabled``: else nothing is shown)."""
        if not enabled:
            return contextlib.nullcontext()
        self._live = Live(self.render(), console=console, refresh_per_second=4,
                          transient=True)
        return self._live

    def show(self) -> None:
        """Redraw the live view, if any."""
        if self._live is not None:
            self._live.update(self.render())

    def done(self, o: Outcome) -> None:
        (self.errors if o.error else self.finished)[o.model] += 1
        self.show()

    def render(self) -> Table:
        t = Table(title=f"{self.mode}: {time.perf_counter() - self.start:.0f} s")
        for col in ("model", "done", "errors", self.memory_label):
            t.add_column(col, justify="left" if col == "model" else "right")
        for m in self.total:
            t.add_row(m, f"{self.finished[m]}/{self.total[m]}", str(self.errors[m]),
                      format_size(self.memory.get(m, 0)))
        return t
