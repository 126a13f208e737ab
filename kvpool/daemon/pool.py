"""The daemon's physical pages: creation, the warm pool, retirement, budget accounting.

Every page the daemon holds has a page id (pfn) and sits in exactly one place:

* ``warm``  — never exported to any tenant (freshly created, zeroed), ready to grant;
* ``dirty`` — released by a tenant (``last owner`` kept), not yet retired;
* ``owner`` — granted to a tenant (its region tables say where).

Leases are a count (``leased``): memory a tenant uses through its own allocator, which
the pool keeps free by creating fewer pages. ``retained`` lists pages the daemon has
retired (dropped its own handle) while another process still references them: a tenant
that kept a descriptor or a mapping of a page it released keeps that memory alive, so
it stays charged to that tenant and to the budget until it is gone
(:meth:`recheck_retained`, on the liveness timer). When the tenant's session ends its
retained pages (and its released pages not yet retired) are charged to its
:class:`Payer` — its uid, and its name where configured — so that every later session
of that uid (or name) counts them against its ``max`` (:meth:`charged`): cycling
sessions does not shed them.

Fresh pages (ARCHITECTURE.md): a physical page handed to a tenant was never exported to any
other tenant. A released page goes back only to the tenant that released it (``take``
prefers the caller's own dirty pages); for anyone else it is *retired* — its handle
released — and a fresh page (a new memfd on host, a new ``cuMemCreate`` allocation on
CUDA) takes its place. Idle time does this (:meth:`maintain`: retire dirty pages, feed
the warm pool with fresh ones, faulted in where the backend commits nothing more by it:
``Backend.prefault``), so grants find fresh pages ready; a grant creates pages itself
only when the warm pool runs out (those stay cold).

Invariants (checked by :meth:`check`): the three places are disjoint and cover
``pages``; ``len(pages) + leased + len(retained) <= budget_pages`` — warm, dirty and
retained pages count (on CUDA they are real device memory), and the warm pool is
trimmed first whenever that sum is over the budget (adopted pages after a restart may
exceed it until tenants shrink); ``warm_min <= warm_max <= budget_pages``.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Collection, Iterator

from kvpool.vmm import Backend, Page, VmmError

log = logging.getLogger("kvpool.daemon.pool")

RECHECK_BUDGET_S = 0.002  # probing retained pages: at most this long per call
LOG_EVERY_S = 1.0  # at most one log line a second about pages found retained


class PoolExhausted(Exception):
    """The budget (or the device) cannot supply the pages asked (answered ``NO_MEMORY``)."""


def _same_payer(p: "Payer", payer: "Payer") -> bool:
    """Whether ``p`` is charged with ``payer``: the same uid, or the same configured name."""
    return p.uid == payer.uid or (bool(payer.name) and p.name == payer.name)


@dataclass(frozen=True)
class Payer:
    """Who pays for a vanished session's retained pages: its ``uid``, and its ``name``
    when the daemon's config gives that name a policy ("" otherwise)."""

    uid: int
    name: str = ""


@dataclass(eq=False)
class Retained:
    """A retired page another process still references: ``probe`` is the daemon's
    handle for asking the backend whether it still does. ``tenant`` pays for it while
    its session lives; once it has ended (``tenant`` 0), ``payer`` does."""

    probe: Page
    tenant: int
    since: float
    payer: Payer | None = None


class Pool:
    def __init__(self, backend: Backend, budget_pages: int, warm_min: int = 0, warm_max: int = 0):
        self.backend = backend
        self.page_size = backend.page_size
        self.budget_pages = budget_pages
        self.warm_min = max(0, min(warm_min, budget_pages))
        self.warm_max = min(max(warm_max, self.warm_min), budget_pages)
        self.pages: dict[int, Page] = {}
        self.warm: list[int] = []  # stack: hot pages first
        # pfn -> last owner, oldest release first (ordered: O(1) to take the oldest)
        self.dirty: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._dirty_of: dict[int, dict[int, None]] = {}  # last owner -> its dirty pfns
        self.owner: dict[int, int] = {}  # pfn -> tenant id
        self.retained: list[Retained] = []
        self._ended: dict[int, Payer] = {}  # ended tenant with dirty pages -> its payer
        self._recheck_at: int | None = None  # where the recheck pass under way is
        self._unlogged = 0  # pages found retained since the last log line about them
        self._logged_at = 0.0
        self._next_pfn = 1
        self.created = 0  # pages that grew the pool (a counter, for stats)
        self.renewed = 0  # fresh pages created in place of a retired one
        self.leased = 0  # pages leased to tenants (no page object: a budget count)
        _ignore_lease_breaks()

    # ---- accounting -------------------------------------------------------------
    @property
    def granted(self) -> int:
        return len(self.owner)

    @property
    def free(self) -> int:
        """Pages that could still be created within the budget."""
        return max(0, self.budget_pages - len(self.pages) - self.leased - len(self.retained))

    @property
    def available(self) -> int:
        """Pages a grant could get right now: the budget less what is granted, leased or
        retained (warm + dirty + creatable, except that pages over the budget count not)."""
        return max(0, self.budget_pages - self.granted - self.leased - len(self.retained))

    def retained_pages(self, tenant: int | None = None) -> int:
        """Retired pages still referenced (by ``tenant``'s doing, or in all)."""
        if tenant is None:
            return len(self.retained)
        return sum(1 for r in self.retained if r.tenant == tenant)

    def charged(self, tenant: int, payer: Payer) -> int:
        """Pages charged to live session ``tenant`` (paid for by ``payer``) besides what
        it holds: the retained pages it released, and those of ended sessions whose
        payer has its uid (or its configured name): retained, or released and not
        yet retired (they may turn out retained; counted until they are retired)."""
        n = sum(1 for r in self.retained if r.tenant == tenant
                or (r.payer is not None and r.tenant == 0 and _same_payer(r.payer, payer)))
        return n + sum(len(self._dirty_of.get(t, ())) for t, p in self._ended.items()
                       if _same_payer(p, payer))

    def settle_ended(self, payer: Payer) -> int:
        """Retire now the released pages of ended sessions paid for by ``payer``'s uid (or
        name), so that :meth:`charged` counts only those still referenced (retained) and
        not those nobody maps any more (a killed tenant's). For a grant that
        :meth:`charged` would otherwise refuse; each page is probed once, after which it
        is either gone or retained. Returns how many pages were retired."""
        pfns = [pfn for t, p in list(self._ended.items()) if _same_payer(p, payer)
                for pfn in list(self._dirty_of.get(t, ()))]
        for pfn in pfns:
            self._retire(pfn)
        return len(pfns)

    def retained_by_uid(self, live_uids: dict[int, int]) -> dict[int, int]:
        """Retained pages per uid: live sessions' (``live_uids``: tenant id -> uid) and
        ended sessions' (their payer's uid)."""
        out: dict[int, int] = {}
        for r in self.retained:
            uid = r.payer.uid if r.payer is not None and r.tenant == 0 \
                else live_uids.get(r.tenant)
            if uid is not None:
                out[uid] = out.get(uid, 0) + 1
        return out

    def ended(self, tenant: int, payer: Payer) -> None:
        """``tenant``'s session ended (after it gave everything back), or the weight set
        of owner id ``tenant`` (negative) was dropped: what it retained, and what of its
        released pages turns out retained later, is ``payer``'s."""
        for r in self.retained:
            if r.tenant == tenant:
                r.tenant, r.payer = 0, payer
        if tenant in self._dirty_of:
            self._ended[tenant] = payer

    # ---- grant / give back ----------------------------------------------------------
    def take(self, n: int, tenant: int) -> list[int]:
        """``n`` pages for ``tenant`` (all or none): its own released pages first, then
        fresh ones (warm, else created now, retiring others' released pages for room)."""
        if n > self.available:
            raise PoolExhausted(
                f"{n} pages asked, {self.available} available (budget {self.budget_pages}, "
                f"granted {self.granted}, retained {len(self.retained)})"
            )
        own = [pfn for pfn, _ in zip(self._own_dirty(tenant), range(n))]
        for pfn in own:
            self._undirty(pfn)
        fresh: list[int] = []
        try:
            while len(own) + len(fresh) < n and self.warm:
                fresh.append(self.warm.pop())
            while len(own) + len(fresh) < n:
                if self.free == 0 and self.dirty:
                    self._retire(next(iter(self.dirty)))  # room for a fresh page
                    continue
                fresh.append(self._create())
        except (VmmError, OSError, PoolExhausted) as e:
            for pfn in own:  # roll back: nothing was exported by this call
                self._dirty(pfn, tenant)
            self.warm.extend(reversed(fresh))
            raise PoolExhausted(f"could not supply {n} pages: {e}") from e
        out = own + fresh
        for pfn in out:
            self.owner[pfn] = tenant
        return out

    def take_sealable(self, n: int, owner: int) -> list[int]:
        """``n`` fresh pages for a weight set (``owner``: its id in ``owner``, negative),
        created now so that they can be sealed read-only later (warm pages are sealed
        for good already); room is made by retiring released pages, then by destroying
        warm ones. All or none."""
        if n > self.available:
            raise PoolExhausted(f"{n} pages asked, {self.available} available")
        while self.free < n and self.dirty:
            self._retire(next(iter(self.dirty)))
        while self.free < n and self.warm:
            self._destroy(self.warm.pop(0))
        if self.free < n:  # retired pages were still referenced
            raise PoolExhausted(f"{n} pages asked, {self.free} can be created "
                                f"({len(self.retained)} retained pages still referenced)")
        out: list[int] = []
        try:
            for _ in range(n):
                out.append(self._hold(self.backend.create_sealable_page()))
                self.created += 1
        except (VmmError, OSError) as e:
            for pfn in out:
                self._destroy(pfn)
            raise PoolExhausted(f"could not create {n} weight pages: {e}") from e
        for pfn in out:
            self.owner[pfn] = owner
        return out

    def seal(self, pfns: list[int]) -> None:
        """Make pages ``pfns`` read-only for good (``Backend.seal_read_only``; raises
        its ``VmmError`` while one is still mapped writable somewhere)."""
        for pfn in pfns:
            self.backend.seal_read_only(self.pages[pfn])

    def seal_writer(self, pfns: list[int]) -> None:
        """Make pages ``pfns`` read-only for every mapping made from now on, the
        writable ones that exist (a mutable set's writer's) staying
        (``Backend.seal_future_write``)."""
        for pfn in pfns:
            self.backend.seal_future_write(self.pages[pfn])

    def give_back(self, pfns: list[int], tenant: int) -> None:
        """Pages ``tenant`` no longer maps: only ``tenant`` may get them back; they are
        retired before anyone else is served."""
        for pfn in pfns:
            del self.owner[pfn]
            self._dirty(pfn, tenant)

    def _dirty(self, pfn: int, tenant: int) -> None:
        self.dirty[pfn] = tenant
        self._dirty_of.setdefault(tenant, {})[pfn] = None

    def _undirty(self, pfn: int) -> int:
        tenant = self.dirty.pop(pfn)
        mine = self._dirty_of[tenant]
        del mine[pfn]
        if not mine:
            del self._dirty_of[tenant]
            self._ended.pop(tenant, None)
        return tenant

    def _own_dirty(self, tenant: int) -> Iterator[int]:
        return iter(list(self._dirty_of.get(tenant, ())))

    # ---- retirement -------------------------------------------------------------------
    def _retire(self, pfn: int) -> None:
        """Drop a released page for good; while another process still references its
        memory it stays charged (``retained``) to the tenant that released it."""
        payer = self._ended.get(self.dirty[pfn])  # (an ended session's: its payer's)
        tenant = self._undirty(pfn)
        page = self.pages.pop(pfn)
        try:
            probe = self.backend.retire(page)
        except (VmmError, OSError) as e:  # pragma: no cover - defensive
            log.error("retiring page %d failed: %s", pfn, e)
            return
        if probe is not None:
            now = time.monotonic()
            self.retained.append(Retained(probe, 0 if payer else tenant, now, payer))
            self._unlogged += 1  # one line a second at most, whatever a peer makes us retire
            if now - self._logged_at >= LOG_EVERY_S:
                log.info("%d released pages still referenced, charged as retained (the "
                         "latest: page %d of tenant %d)", self._unlogged, pfn, tenant)
                self._unlogged, self._logged_at = 0, now

    def recheck_retained(self, budget_s: float = RECHECK_BUDGET_S) -> int:
        """Forget retained pages nobody references any more, probing for at most about
        ``budget_s`` (a tenant decides how many pages are retained: it must not decide
        how long one loop turn takes). A pass starts on the liveness timer and goes on
        from where it stopped in later calls (idle work, :meth:`maintain`) until every
        retained page was probed once. Returns how many pages went."""
        deadline = time.monotonic() + budget_s
        i = self._recheck_at or 0
        gone = 0
        while i < len(self.retained):
            r = self.retained[i]
            try:
                still = self.backend.referenced(r.probe)
            except (VmmError, OSError):  # pragma: no cover - defensive
                still = None
            if still:
                i += 1
            else:  # (order does not matter: the last one moves here, probed next)
                self.backend.release(r.probe)
                self.retained[i] = self.retained[-1]
                self.retained.pop()
                gone += 1
            if time.monotonic() >= deadline:
                break
        self._recheck_at = i if i < len(self.retained) else None
        return gone

    @property
    def rechecking(self) -> bool:
        """A recheck pass of the retained pages is under way (idle work continues it)."""
        return self._recheck_at is not None

    # ---- handoff: the giver's references ---------------------------------------------------
    def rehandle(self, pfns: list[int]) -> bool:
        """Give each page of ``pfns`` a new handle sharing nothing with the descriptors
        exported so far (its old handle released), so that :meth:`referenced_elsewhere`
        tells when their holders have let go; False (nothing changed for the pages not
        done, the done ones keep their new handle) when the backend cannot."""
        for pfn in pfns:
            page = self.pages[pfn]
            new = self.backend.reopen(page)
            if new is None:
                return False
            self.backend.release(page)
            self.pages[pfn] = new
        return True

    def referenced_elsewhere(self, pfn: int) -> bool | None:
        """Whether a descriptor or mapping of page ``pfn`` exists besides the daemon's
        handle (after :meth:`rehandle`: one exported before it); None: cannot tell."""
        try:
            return self.backend.referenced(self.pages[pfn])
        except (VmmError, OSError):  # pragma: no cover - defensive
            return None

    def retire_kept(self, pfns: list[int], tenant: int, payer: Payer | None) -> int:
        """Owned pages ``pfns`` go for good, never to be handed on (another process kept
        references to them): those still referenced are retained, charged to live
        session ``tenant`` or, when it is 0, to ``payer``. Returns how many were."""
        n = 0
        for pfn in pfns:
            del self.owner[pfn]
            page = self.pages.pop(pfn)
            try:
                probe = self.backend.retire(page)
            except (VmmError, OSError) as e:  # pragma: no cover - defensive
                log.error("retiring page %d failed: %s", pfn, e)
                continue
            if probe is not None:
                self.retained.append(Retained(probe, tenant, time.monotonic(),
                                              payer if tenant == 0 else None))
                n += 1
        return n

    # ---- leases and adoption -----------------------------------------------------------
    def lease(self, n: int) -> None:
        """Count ``n`` more pages as leased, retiring dirty and destroying warm pages to
        make room."""
        if n > self.available:
            raise PoolExhausted(f"{n} pages asked for a lease, {self.available} available")
        while self.free < n and self.dirty:
            self._retire(next(iter(self.dirty)))
        while self.free < n and self.warm:
            self._destroy(self.warm.pop(0))
        if self.free < n:  # retired pages were still referenced
            raise PoolExhausted(f"{n} pages asked for a lease, {self.free} free "
                           f"({len(self.retained)} retained pages still referenced)")
        self.leased += n

    def unlease(self, n: int) -> None:
        self.leased -= min(n, self.leased)

    def adopt(self, page: Page, tenant: int) -> int:
        """Take ownership of a page a tenant still maps after a daemon restart."""
        pfn = self._hold(page)
        self.owner[pfn] = tenant
        return pfn

    def _hold(self, page: Page) -> int:
        """Give ``page`` the next pfn (it is in ``pages``, nowhere else yet)."""
        pfn = self._next_pfn
        self._next_pfn += 1
        self.pages[pfn] = page
        return pfn

    def _new_page(self) -> Page:
        """A fresh page, zeroed (a fresh memfd reads zeros; device memory may not)."""
        page = self.backend.create_page()
        if not self.backend.caps.fresh_pages_zeroed:
            try:
                self.backend.zero(page)
            except VmmError:
                self.backend.release(page)
                raise
        return page

    def _create(self) -> int:
        if self.free <= 0:
            raise PoolExhausted("budget exhausted")
        pfn = self._hold(self._new_page())
        self.created += 1
        return pfn

    # ---- idle work --------------------------------------------------------------------
    @property
    def over_budget(self) -> int:
        return max(0, len(self.pages) + self.leased + len(self.retained) - self.budget_pages)

    def has_work(self) -> bool:
        return bool(self.dirty) or self._warm_target() != len(self.warm) or self.rechecking

    def _warm_target(self) -> int:
        n = len(self.warm)
        if self.over_budget:
            return max(0, n - self.over_budget)
        if n < self.warm_min:
            return min(self.warm_min, n + self.free)
        if n > self.warm_max:
            return self.warm_max
        return n

    def maintain(self, budget_s: float = 0.002) -> int:
        """Idle work for at most about ``budget_s``: go on with a recheck pass of the
        retained pages; retire released pages, each replaced by a fresh warm page while
        the warm pool is under ``warm_max`` and the budget has room; then trim the warm
        pool to the budget and ``warm_max``, and refill it to ``warm_min`` with fresh
        pages. Returns how many retained pages went (waiting grants may fit)."""
        gone = self.recheck_retained(budget_s / 2) if self.rechecking else 0
        deadline = time.monotonic() + budget_s
        while self.dirty and time.monotonic() < deadline:
            self._retire(next(iter(self.dirty)))
            if len(self.warm) < self.warm_max and self.free > 0 and not self._renew():
                break
        while len(self.warm) > self._warm_target() and time.monotonic() < deadline:
            self._destroy(self.warm.pop(0))  # coldest first
        while len(self.warm) < self._warm_target() and time.monotonic() < deadline:
            try:
                pfn = self._create()
            except (VmmError, OSError, PoolExhausted) as e:
                log.warning("warm pool refill stopped: %s", e)
                self.warm_min = len(self.warm)
                break
            self._prefault(self.pages[pfn])
            self.warm.insert(0, pfn)  # coldest first (never granted; see _prefault)
        return gone

    def _prefault(self, page: Page) -> None:
        """A warm page's memory allocated and zeroed now, in idle time, where the
        backend commits nothing more by it (hugetlb: reserved at creation), so that the
        tenant it is granted to does not pay the first-touch zeroing on its grant or
        step path (``Backend.prefault``); a page that cannot be stays as it is."""
        try:
            self.backend.prefault(page)
        except (VmmError, OSError) as e:
            log.debug("prefault of a warm page failed (it stays cold): %s", e)

    def _renew(self) -> bool:
        """A fresh warm page in place of a retired one; False when none could be made."""
        try:
            page = self._new_page()
        except (VmmError, OSError) as e:
            log.warning("could not create a fresh page: %s", e)
            return False
        self.renewed += 1
        self._prefault(page)
        self.warm.insert(0, self._hold(page))
        return True

    def _destroy(self, pfn: int) -> None:
        """Release a page no tenant has ever been given (warm) or at shutdown."""
        page = self.pages.pop(pfn)
        try:
            self.backend.release(page)
        except VmmError as e:  # pragma: no cover - defensive
            log.error("releasing page %d failed: %s", pfn, e)

    def close(self) -> None:
        """Release every page (daemon shutdown). Tenants' mappings keep their memory."""
        for pfn in list(self.pages):
            self._destroy(pfn)
        for r in self.retained:
            self.backend.release(r.probe)
        self.retained.clear()
        self._recheck_at = None
        self.warm.clear()
        self.dirty.clear()
        self._dirty_of.clear()
        self._ended.clear()
        self.owner.clear()
        self.leased = 0

    # ---- integrity --------------------------------------------------------------------
    def check_charges(self, live: Collection[int]) -> list[str]:
        """Every retained page, and every released page not yet retired, is charged to
        someone: a live session of ``live`` (tenant ids), or a payer (an ended session's,
        a dropped weight set's)."""
        problems: list[str] = []
        unpaid = sorted({r.tenant for r in self.retained
                         if (r.payer is None or r.tenant != 0) and r.tenant not in live})
        if unpaid:
            problems.append(f"retained pages are charged to no one (released by ids "
                            f"{unpaid[:8]}, neither live nor paid for)")
        loose = sorted(t for t in self._dirty_of if t not in live and t not in self._ended)
        if loose:
            problems.append(f"released pages of ids {loose[:8]} have no live tenant and no "
                            f"payer")
        return problems

    def check(self) -> list[str]:
        problems: list[str] = []
        warm, dirty, owned = set(self.warm), set(self.dirty), set(self.owner)
        if len(warm) != len(self.warm):
            problems.append("a pfn is in the warm pool twice")
        by_owner = {pfn for pfns in self._dirty_of.values() for pfn in pfns}
        if by_owner != dirty:
            problems.append("the dirty list and its per-tenant index disagree")
        if not set(self._ended) <= set(self._dirty_of):
            problems.append("an ended session without released pages has a payer kept")
        for a, b, what in ((warm, dirty, "warm and dirty"), (warm, owned, "warm and granted"),
                           (dirty, owned, "dirty and granted")):
            both = a & b
            if both:
                problems.append(f"pfns {sorted(both)[:8]} are both {what}")
        everywhere = warm | dirty | owned
        if everywhere != set(self.pages):
            lost = set(self.pages) - everywhere
            ghosts = everywhere - set(self.pages)
            if lost:
                problems.append(f"pfns {sorted(lost)[:8]} are held but nowhere (leaked)")
            if ghosts:
                problems.append(f"pfns {sorted(ghosts)[:8]} are listed but not held")
        held = len(self.pages) + self.leased + len(self.retained)
        if held > self.budget_pages:
            problems.append(f"{len(self.pages)} pages held + {self.leased} leased + "
                            f"{len(self.retained)} retained exceed the budget of "
                            f"{self.budget_pages}")
        if not 0 <= self.warm_min <= self.warm_max <= self.budget_pages:
            problems.append(f"warm pool bounds {self.warm_min}..{self.warm_max} are not "
                            f"within the budget of {self.budget_pages}")
        for pfn, page in self.pages.items():
            if page.released:
                problems.append(f"pfn {pfn} holds a released page")
                break
        return problems


def _ignore_lease_breaks() -> None:
    """The host backend probes retired pages with a momentary file lease; should anyone
    open such a file during the probe, the kernel signals SIGIO, whose default action
    would end the daemon."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGIO, signal.SIG_IGN)
