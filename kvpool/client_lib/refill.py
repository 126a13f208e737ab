"""The allocator's background thread: refill and trim the reserve, serve demand, report.

One :class:`Refiller` per :class:`~kvpool.client_lib.allocator.ElasticBlockAllocator`.
Each step (:meth:`Refiller.rebalance`, every ``tick_s`` or when woken):

* *demand*: chunks a non-waiting ``alloc`` could not get (and a reserve of ``high``
  besides) are asked for in one grant the daemon may hold while it reclaims from others;
  they land in the reserve. When the daemon refuses that (the reserve would take the
  tenant past its fair share: "at its fair share"), the missing chunks alone are asked
  for at once, so a tenant below its fair share always gets what its requests need;
* *refill*: below ``low`` reserve chunks, one speculative grant up to ``high`` (served
  from free memory only, never making the daemon reclaim from others) — once *armed*:
  from the start, and after a :meth:`Refiller.disarm` (the engine slept) only once a
  grant for demand (a slow-path ``alloc``, whole chunks, background demand) showed that
  the mapped chunks no longer cover the engine's requests; so a wake maps what its first
  requests need, not a reserve besides (issue 36 item 5);
* *trim*: above ``high``, one release of the surplus; after ``idle_timeout_s`` without
  alloc/free the watermarks are 0 and the reserve drains completely;
* *report*: the reserve and bytes in use go to the daemon (for ``ps``/``map``) at most
  every ``report_interval_s``, and only when they changed.

Refused grants back off; a reclaim pauses refills (:meth:`pause`). While the daemon is
away (restart) the thread idles; the tenant's own thread reconnects. The demand and
back-off fields are read and written under the allocator's lock.

The refiller sees its allocator only through :class:`ReserveOwner` (it does not import
the allocator, which builds it with ``Refiller(self, ...)``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Iterable, Protocol

if TYPE_CHECKING:
    from kvpool.client_lib.chunk_book import ChunkBook
    from kvpool.client_lib.regions import BlockGroup

log = logging.getLogger("kvpool.client")

AWAY_POLL_S = 0.05  # how often to look whether the daemon is back
ERROR_BACKOFF_S = 0.5  # after an unexpected error in a step
REFUSED_BACKOFF_S = 0.2  # after a refused refill (NO_MEMORY / OVER_LIMIT)
DEMAND_RETRY_S = 0.02  # after a refused demand grant: do not hammer
RECLAIM_PAUSE_S = 1.0  # the daemon wanted memory elsewhere: no refill for this long


class ReserveOwner(Protocol):
    """The allocator a :class:`Refiller` keeps the reserve of (an
    :class:`~kvpool.client_lib.allocator.ElasticBlockAllocator`).

    Obligations: ``lock`` guards ``book`` and the refiller's demand (``has_demand``/
    ``add_demand`` are called under it); the refiller reads ``book`` only under ``lock``.
    ``grow_reserve`` (grant in-flight chunks into the reserve; False when refused) and
    ``release_reserve_chunks`` (release up to ``k`` reserve chunks; how many left the
    reserve) take the lock themselves and are called without it, as are
    ``reserve_units`` and ``in_use_bytes`` (what :meth:`Refiller.report` sends). The
    watermarks and intervals may change at any time; each step reads them afresh. While
    ``suspended`` (the engine sleeps) a step does nothing."""

    lock: threading.Lock
    suspended: bool
    book: ChunkBook
    @property
    def group(self) -> BlockGroup: ...
    low: int
    high: int
    idle_timeout_s: float
    tick_s: float
    report_interval_s: float

    def grow_reserve(self, chunks: list[int], speculative: bool) -> bool: ...
    def release_reserve_chunks(self, k: int) -> int: ...
    def reserve_units(self, extra: Iterable[int] = ()) -> list[int]: ...
    def in_use_bytes(self) -> int: ...


class Refiller:
    def __init__(self, alloc: ReserveOwner, start: bool) -> None:
        self._alloc = alloc
        self._wake = threading.Event()
        self._stopped = False
        self._last_ops = -1
        self._last_active = time.monotonic()
        self._last_report = 0.0
        self._reported: tuple[tuple[int, ...], int] | None = None
        self._backoff_until = 0.0
        self._demand = 0  # chunks non-waiting allocs could not get, and a reserve
        self._demand_need = 0  # of which the chunks they could not get
        self._demand_after = 0.0
        self._armed = True  # refills may run (see the module: disarm, arm)
        self._thread: threading.Thread | None = None
        self._step = threading.Lock()  # held across one rebalance (quiet() waits for it)
        if start:
            self.start()

    def start(self) -> None:
        """Start the background thread (once)."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"kvpool-refill-{self._alloc.group.id}")
            self._thread.start()

    # ---- called by the allocator (demand and pause under its lock) ----------------
    def wake(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def has_demand(self) -> bool:
        return self._demand > 0

    def add_demand(self, chunks: int, reserve: int = 0) -> None:
        """Ask for at least ``chunks`` chunks and ``reserve`` more on the next step (one
        reclaim round; ``chunks`` alone when the daemon refuses both); the engine's
        requests outran its mapped chunks, so refills run again (:meth:`arm`)."""
        self._demand = max(self._demand, chunks + reserve)
        self._demand_need = max(self._demand_need, chunks)
        self._armed = True

    def arm(self) -> None:
        """(allocator lock held) A grant for demand happened: keep the reserve between the
        watermarks again."""
        self._armed = True

    def disarm(self) -> None:
        """(allocator lock held) No refill until the next grant for demand (:meth:`arm`):
        the engine sleeps, and its wake maps only what its first requests take."""
        self._armed = False

    def clear_demand(self) -> None:
        """(allocator lock held) Forget the demand (the engine goes to sleep)."""
        self._demand = self._demand_need = 0

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No refill step runs inside (one under way is waited for)."""
        with self._step:
            yield

    def pause(self) -> None:
        """No refill for ``RECLAIM_PAUSE_S`` (a reclaim just took memory back)."""
        self._backoff_until = max(self._backoff_until, time.monotonic() + RECLAIM_PAUSE_S)

    def stop(self) -> None:
        """End the thread (joins it unless called from it)."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            self._thread = None

    # ---- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        tenant = self._alloc.group.tenant
        while not self._stopped:
            self._wake.wait(self._alloc.tick_s)
            self._wake.clear()
            if self._stopped or tenant.closed:
                break
            if not tenant.connected:  # the daemon is away: the tenant thread reconnects
                self._wake.wait(AWAY_POLL_S)
                continue
            try:
                self.rebalance()
                self.maybe_report()
            except Exception as e:
                if self._stopped or tenant.closed:
                    break
                if tenant.connected:
                    log.warning("refill thread: %s", e)
                self._backoff_until = time.monotonic() + ERROR_BACKOFF_S

    def rebalance(self) -> None:
        """One demand/refill/trim step (the thread calls this; tests may too)."""
        with self._step:
            if not self._alloc.suspended:
                self._rebalance()

    def _rebalance(self) -> None:
        a = self._alloc
        if self._demand and time.monotonic() >= self._demand_after:
            self._serve_demand()
        now = time.monotonic()
        with a.lock:
            book = a.book
            if book.ops != self._last_ops:
                self._last_ops = book.ops
                self._last_active = now
            idle = now - self._last_active >= a.idle_timeout_s
            low, high = (0, 0) if idle else (a.low, a.high)
            if idle:
                book.demote_if_empty()  # an empty current chunk drains too
            r = book.reserve_size
            grow = high - r if r < low and self._armed and now >= self._backoff_until else 0
            chunks = book.pick_unmapped(min(grow, book.unmapped_size)) if grow else None
        if chunks:
            if not a.grow_reserve(chunks, speculative=True):
                self._backoff_until = time.monotonic() + REFUSED_BACKOFF_S
        elif r > high:
            a.release_reserve_chunks(r - high)

    def _serve_demand(self) -> None:
        """Ask for the chunks non-waiting allocs missed, waiting as long as the daemon holds
        the grant for reclaim; they land in the reserve for the next ``alloc``."""
        a = self._alloc
        with a.lock:
            k, need = self._demand, self._demand_need
            self._demand = self._demand_need = 0
            chunks = a.book.pick_unmapped(min(k, a.book.unmapped_size))
        if not chunks or a.grow_reserve(chunks, speculative=False):
            return
        if 0 < need < len(chunks):  # refused with the reserve: what is missing alone
            with a.lock:
                chunks = a.book.pick_unmapped(min(need, a.book.unmapped_size))
            if not chunks or a.grow_reserve(chunks, speculative=False):
                return
        self._demand_after = time.monotonic() + DEMAND_RETRY_S

    # ---- reports ------------------------------------------------------------------------
    def _state(self) -> tuple[tuple[int, ...], int]:
        return tuple(self._alloc.reserve_units()), self._alloc.in_use_bytes()

    def report(self) -> None:
        """Tell the daemon the current reserve and bytes in use."""
        state = self._state()
        self._alloc.group.set_usage(in_use=state[1], reserve=list(state[0]))
        self._reported = state
        self._last_report = time.monotonic()

    def maybe_report(self) -> None:
        """Report if ``report_interval_s`` passed and the state changed since the last."""
        if time.monotonic() - self._last_report < self._alloc.report_interval_s:
            return
        if self._state() != self._reported:
            self.report()
        else:
            self._last_report = time.monotonic()
