"""The daemon's physical pages: creation, the warm pool, zeroing, and budget accounting.

Every page the daemon holds has a page id (pfn) and sits in exactly one place:

* ``warm``  — zeroed and unowned, ready to grant;
* ``dirty`` — released by a tenant (``last owner`` kept) and not yet zeroed;
* ``owner`` — granted to a tenant (its region tables say where).

Leases are a count (``leased``): memory a tenant uses through its own allocator, which
the pool keeps free by creating fewer pages.

Invariants (checked by :meth:`Pool.check`): those three are disjoint and cover
``pages``; ``len(pages) + leased <= budget_pages`` (after a restart, adopted pages may
exceed it until tenants shrink), so the budget is never exceeded (warm and dirty pages
count: on CUDA they are real device memory). A page that changes tenant is scrubbed
first: ``take`` scrubs a dirty page of another owner before granting it, and idle time
scrubs the rest (:meth:`maintain`). On the host backend scrubbing replaces the memfd
with a fresh one (so a tenant that kept a descriptor or mapping of a page it released
can never see the next tenant's data: there is no revoke on host); on CUDA it zeroes.
"""

from __future__ import annotations

import collections
import logging
import os
import time

from kvpool.vmm import Backend, Page, VmmError

log = logging.getLogger("kvpool.daemon.pool")


class NoMemory(Exception):
    """The budget (or the device) cannot supply the pages asked for."""


class Pool:
    def __init__(self, backend: Backend, budget_pages: int, warm_min: int = 0, warm_max: int = 0):
        self.backend = backend
        self.page_size = backend.page_size
        self.budget_pages = budget_pages
        self.warm_min = min(warm_min, budget_pages)
        self.warm_max = max(warm_max, self.warm_min)
        self.pages: dict[int, Page] = {}
        self.warm: list[int] = []  # stack: hot pages first
        self.dirty: collections.deque[tuple[int, int]] = collections.deque()  # (pfn, last owner)
        self.owner: dict[int, int] = {}  # pfn -> tenant id
        self._next_pfn = 1
        self.created = 0  # pages created since start (a counter, for stats)
        self.leased = 0  # pages leased to tenants (no page object: a budget count)
        self.fresh_on_scrub = backend.name == "host"

    # ---- accounting -------------------------------------------------------------
    @property
    def granted(self) -> int:
        return len(self.owner)

    @property
    def free(self) -> int:
        """Pages that could still be created within the budget."""
        return max(0, self.budget_pages - len(self.pages) - self.leased)

    @property
    def available(self) -> int:
        """Pages a grant could get right now: warm + dirty + creatable."""
        return len(self.warm) + len(self.dirty) + self.free

    # ---- grant / give back ----------------------------------------------------------
    def take(self, n: int, tenant: int) -> list[int]:
        """``n`` pages for ``tenant`` (all or none), zeroed unless last owned by it."""
        if n > self.available:
            raise NoMemory(
                f"{n} pages asked, {self.available} available "
                f"(budget {self.budget_pages}, granted {self.granted})"
            )
        out: list[int] = []
        try:
            while len(out) < n and self.warm:
                out.append(self.warm.pop())
            while len(out) < n and self.dirty:
                pfn, last = self.dirty.popleft()
                if last != tenant:
                    out.append(pfn)  # appended first so a failed zero still rolls back
                    self._scrub(pfn)
                else:
                    out.append(pfn)
            while len(out) < n:
                out.append(self._create())
        except (VmmError, OSError) as e:
            # Roll back: every page taken so far is clean or this tenant's own; mark all
            # of them dirty with an owner no tenant has, so each is zeroed before reuse.
            for pfn in out:
                self.dirty.append((pfn, -1))
            raise NoMemory(f"backend could not supply pages: {e}") from e
        for pfn in out:
            self.owner[pfn] = tenant
        return out

    def give_back(self, pfns: list[int], tenant: int) -> None:
        """Pages ``tenant`` no longer maps; they are zeroed before anyone else gets them."""
        for pfn in pfns:
            del self.owner[pfn]
            self.dirty.append((pfn, tenant))

    def _scrub(self, pfn: int) -> None:
        """Make ``pfn`` safe for another tenant: a fresh memfd on host, zeroes elsewhere."""
        if self.fresh_on_scrub:
            page = self.backend.create_page()
            old, self.pages[pfn] = self.pages[pfn], page
            self.backend.release(old)
        else:
            self.backend.zero(self.pages[pfn])

    # ---- leases and adoption -----------------------------------------------------------
    def lease(self, n: int) -> None:
        """Count ``n`` more pages as leased, destroying warm/dirty pages to make room."""
        if n > self.available:
            raise NoMemory(f"{n} pages asked for a lease, {self.available} available")
        while self.free < n and self.dirty:
            self._destroy(self.dirty.popleft()[0])
        while self.free < n and self.warm:
            self._destroy(self.warm.pop(0))
        self.leased += n

    def unlease(self, n: int) -> None:
        self.leased -= min(n, self.leased)

    def adopt(self, page: Page, tenant: int) -> int:
        """Take ownership of a page a tenant still maps after a daemon restart."""
        pfn = self._next_pfn
        self._next_pfn += 1
        self.pages[pfn] = page
        self.owner[pfn] = tenant
        return pfn

    def page_keys(self) -> set[tuple[int, int]]:
        """``(st_dev, st_ino)`` of every page this pool holds (host backend only)."""
        if self.backend.name != "host":
            return set()
        return {self.page_key_of_fd(page.handle) for page in self.pages.values()}  # type: ignore[misc]

    def page_key_of_fd(self, fd: int) -> tuple[int, int] | None:
        """The identity of a page descriptor (host: its memfd inode), to refuse duplicates."""
        if self.backend.name != "host":
            return None
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino)

    def _create(self) -> int:
        if len(self.pages) + self.leased >= self.budget_pages:
            raise NoMemory("budget exhausted")
        page = self.backend.create_page()
        if self.backend.name != "host":  # a fresh memfd reads zeros; device memory may not
            try:
                self.backend.zero(page)
            except VmmError:
                self.backend.release(page)
                raise
        pfn = self._next_pfn
        self._next_pfn += 1
        self.pages[pfn] = page
        self.created += 1
        return pfn

    # ---- idle work --------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.dirty) or self._warm_target() != len(self.warm)

    def _warm_target(self) -> int:
        n = len(self.warm)
        if n < self.warm_min:
            return min(self.warm_min, n + self.free)
        if n > self.warm_max:
            return self.warm_max
        return n

    def maintain(self, budget_s: float = 0.002) -> None:
        """Idle work for at most about ``budget_s``: zero dirty pages, then move the warm
        pool back between ``warm_min`` and ``warm_max`` (create or destroy pages)."""
        deadline = time.monotonic() + budget_s
        while self.dirty and time.monotonic() < deadline:
            pfn, _ = self.dirty.popleft()
            try:
                self._scrub(pfn)
            except (VmmError, OSError) as e:
                log.error("zeroing page %d failed (%s); destroying it", pfn, e)
                self._destroy(pfn)
                continue
            self.warm.append(pfn)
        while len(self.warm) > self.warm_max and time.monotonic() < deadline:
            self._destroy(self.warm.pop(0))  # coldest first
        while (
            not self.dirty
            and len(self.warm) < self.warm_min
            and self.free > 0
            and time.monotonic() < deadline
        ):
            try:
                pfn = self._create()
            except (VmmError, OSError, NoMemory) as e:
                log.warning("warm pool refill stopped: %s", e)
                self.warm_min = len(self.warm)
                break
            self.warm.insert(0, pfn)  # created pages are cold (not faulted in)

    def _destroy(self, pfn: int) -> None:
        page = self.pages.pop(pfn)
        try:
            self.backend.release(page)
        except VmmError as e:  # pragma: no cover - defensive
            log.error("releasing page %d failed: %s", pfn, e)

    def close(self) -> None:
        """Release every page (daemon shutdown). Tenants' mappings keep their memory."""
        for pfn in list(self.pages):
            self._destroy(pfn)
        self.warm.clear()
        self.dirty.clear()
        self.owner.clear()
        self.leased = 0

    # ---- integrity --------------------------------------------------------------------
    def check(self) -> list[str]:
        problems: list[str] = []
        warm, dirty, owned = set(self.warm), {p for p, _ in self.dirty}, set(self.owner)
        if len(warm) != len(self.warm):
            problems.append("a pfn is in the warm pool twice")
        if len(dirty) != len(self.dirty):
            problems.append("a pfn is in the dirty list twice")
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
        if len(self.pages) + self.leased > self.budget_pages:
            problems.append(f"{len(self.pages)} pages held + {self.leased} leased exceed the "
                            f"budget of {self.budget_pages}")
        for pfn, page in self.pages.items():
            if page.released:
                problems.append(f"pfn {pfn} holds a released page")
                break
        return problems
