"""Observation points: what the arbiter and the reclaimer tell an observer, as they
decide (:class:`kvpool.daemon.observe.Observer` records counters, histograms and the
event log from them). The default observes nothing.

Obligations of an implementation: it only records. It must not raise (an exception
would escape the request or the tick that called it), must not change the daemon's
state, and must be cheap (it runs on the grant path, on the loop's thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpool import protocol as p
    from kvpool.daemon.outcome import Outcome
    from kvpool.daemon.tenants import TenantRecord


class ReclaimObserver(Protocol):
    """What the reclaimer reports."""

    def asked(self, t: TenantRecord, msg: p.Reclaim) -> None:
        """A reclaim ask ``msg`` was queued for ``t``."""

    def gave_back(self, t: TenantRecord, pages: int, mode: str) -> None:
        """``t``, asked to give back (ask in ``mode``), released ``pages``."""


class ArbiterObserver(ReclaimObserver, Protocol):
    """What the arbiter reports (and the reclaimer's points, as it owns one)."""

    def handled(self, req: p.Request, out: Outcome, dt: float, before: int,
                sender: TenantRecord | None) -> None:
        """``req`` got ``out`` after ``dt`` seconds in the arbiter; ``sender`` is the
        session its token named (if any), which held ``before`` pages in its tables."""

    def ticked(self, outs: list[Outcome]) -> None:
        """A tick answered the waiting requests ``outs`` (often none)."""

    def dropped(self, t: TenantRecord, why: str, held: int, arbitrated: bool,
                dt: float) -> None:
        """``t``'s session ended (``why``): it held ``held`` pages, returned in ``dt`` s;
        ``arbitrated`` as it was before the drop."""


class NoObserver:
    """Observes nothing (the default)."""

    def asked(self, t: TenantRecord, msg: p.Reclaim) -> None:
        pass

    def gave_back(self, t: TenantRecord, pages: int, mode: str) -> None:
        pass

    def handled(self, req: p.Request, out: Outcome, dt: float, before: int,
                sender: TenantRecord | None) -> None:
        pass

    def ticked(self, outs: list[Outcome]) -> None:
        pass

    def dropped(self, t: TenantRecord, why: str, held: int, arbitrated: bool,
                dt: float) -> None:
        pass
