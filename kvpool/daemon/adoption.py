"""Adopt: a tenant of the previous daemon hands back what it still maps.

After a restart a returning tenant registers and sends one ``Adopt`` describing every
group it maps, with the pages' descriptors sent ahead on the fd channel (the server
stashes them and puts them in ``t.inbox``). Recovery only, once per recorded pid (and
uid), all or nothing: every check runs before any effect (:meth:`Adoption.check`), a
page already in the pool is refused, and every descriptor the request came with is
closed whatever the outcome (the pool keeps its own reference to the pages it adopts).
An empty Adopt (nothing to report) is always accepted: it changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os

from kvpool import protocol as p
from kvpool.daemon.grants import require_holder
from kvpool.daemon.ledger import Ledger
from kvpool.daemon.outcome import Fail, Sender
from kvpool.daemon.pool import Pool
from kvpool.daemon.regions import GroupIndex, GroupRecord
from kvpool.daemon.restart import Recovery
from kvpool.daemon.tenants import TenantRecord
from kvpool.vmm import Page

log = logging.getLogger("kvpool.daemon")


def page_key(fd: int) -> tuple[int, int]:
    """The identity of a host page descriptor (its memfd's ``(st_dev, st_ino)``), to
    refuse a page the pool holds already or one named twice."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def pool_page_keys(pool: Pool) -> set[tuple[int, int]]:
    """The identity of every page ``pool`` holds (host backend only: CUDA handles are
    not files, and an imported CUDA fd is a new allocation handle anyway)."""
    if not pool.backend.caps.handles_are_fds:
        return set()
    return {page_key(page.handle) for page in pool.pages.values()}


def _empty(r: p.Adopt) -> bool:
    return not r.groups and not r.lease and not r.nfds


class Adoption:
    """Adopts into ``pool`` (through ``ledger``) and ``groups`` while ``recovery`` is
    active, within the per-tenant caps (``max_groups`` groups spanning
    ``max_virtual_pages``)."""

    def __init__(self, pool: Pool, ledger: Ledger, groups: GroupIndex, recovery: Recovery,
                 max_groups: int, max_virtual_pages: int):
        self.pool = pool
        self.ledger = ledger
        self.page_size = pool.page_size
        self.groups = groups
        self.recovery = recovery
        self.max_groups = max_groups
        self.max_virtual_pages = max_virtual_pages

    def adopt(self, t: TenantRecord, sender: Sender, r: p.Adopt) -> p.Reply:
        fds, t.inbox = t.inbox, []
        try:
            return self._adopt(t, r, fds)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _may_adopt(self, t: TenantRecord, r: p.Adopt) -> None:
        """Who may adopt: a memory-holding session of a pid the previous daemon recorded,
        once, while this daemon is recovering."""
        recovery = self.recovery
        require_holder(t, "adopt")
        if _empty(r):
            return
        if not recovery.active:
            raise Fail(p.UNAUTHORIZED, "adopt is accepted only while the daemon recovers "
                                       "after a restart")
        if not recovery.is_expected(t.pid, t.uid):
            raise Fail(p.UNAUTHORIZED, f"pid {t.pid} (uid {t.uid}) was not a tenant of the "
                                       f"previous daemon (or has adopted already)")
        if t.groups or t.lease_pages:
            raise Fail(p.BAD_REQUEST, "adopt must come right after register")

    def check(self, t: TenantRecord, r: p.Adopt, nfds: int) -> int:
        """Validate an Adopt against the state before any effect; returns its pages."""
        ps, pool = self.page_size, self.pool
        total = sum(len(g.units) * g.n_regions for g in r.groups)
        if total != r.nfds or nfds != total:
            raise Fail(p.BAD_REQUEST, f"adopt names {total} pages, says {r.nfds}, "
                                      f"sent {nfds} descriptors")
        ids = [g.id for g in r.groups]
        # ids the previous daemon can have handed out: below the next id it recorded
        top = min(self.groups.next_id, p.MAX_GROUP_ID + 1)
        if any(i >= top for i in ids):
            raise Fail(p.BAD_REQUEST, f"adopt: group ids must be below {top} (ids the "
                                      f"previous daemon handed out)")
        if len(set(ids)) != len(ids) or any(i in self.groups for i in ids):
            raise Fail(p.BAD_REQUEST, "adopt reuses a group id that is taken")
        if len(r.groups) > self.max_groups:
            raise Fail(p.BAD_REQUEST, f"adopt: {len(r.groups)} groups exceed the per-tenant cap")
        virtual = 0
        for g in r.groups:
            npages = g.capacity // ps
            if g.capacity % ps or npages > p.MAX_PAGES_PER_REGION:
                raise Fail(p.BAD_REQUEST, f"adopt: group {g.id} capacity is not a valid "
                                          f"multiple of the page size")
            if len(set(g.units)) != len(g.units):
                raise Fail(p.BAD_REQUEST, f"adopt: group {g.id} names a unit twice")
            if any(u >= npages for u in g.units) or g.chunk_units > npages:
                raise Fail(p.BAD_REQUEST, f"adopt: group {g.id} does not fit its capacity")
            virtual += npages * g.n_regions
        if virtual > self.max_virtual_pages:
            raise Fail(p.BAD_REQUEST, f"adopt: {virtual} virtual pages exceed the per-tenant cap")
        lease = -(-r.lease // ps)
        held = pool.granted + pool.leased + pool.retained_pages()
        if total + lease + held > pool.budget_pages:
            raise Fail(p.BAD_REQUEST, f"adopt: {total} pages and a lease of {lease} pages do "
                                      f"not fit the budget ({pool.budget_pages} pages, "
                                      f"{held} held)")
        if total + lease > t.max_pages:
            raise Fail(p.BAD_REQUEST, f"adopt: {total + lease} pages exceed {t.name}'s limit "
                                      f"of {t.max_pages} pages")
        return total

    def _import(self, fds: list[int]) -> list[Page]:
        """The pages behind ``fds`` (all or none); one the pool holds already is refused."""
        pool = self.pool
        host = pool.backend.caps.handles_are_fds
        known = pool_page_keys(pool)
        pages: list[Page] = []
        keys: set[tuple[int, int]] = set()
        try:
            for fd in fds:
                key = page_key(fd) if host else None
                if key is not None and (key in known or key in keys):
                    raise Fail(p.UNAUTHORIZED, "adopt names a page that is granted already")
                if key is not None:
                    keys.add(key)
                pages.append(pool.backend.import_(fd))
        except Fail:
            for page in pages:
                pool.backend.release(page)
            raise
        except Exception as e:
            for page in pages:
                pool.backend.release(page)
            raise Fail(p.BAD_REQUEST, f"adopt: a descriptor is not a page: {e}") from None
        return pages

    def _adopt(self, t: TenantRecord, r: p.Adopt, fds: list[int]) -> p.Reply:
        self._may_adopt(t, r)
        if _empty(r) and not fds:
            self.recovery.returned(t.pid)
            return p.Adopted(id=r.id, groups=[], pages=0)
        self.check(t, r, len(fds))
        pages = self._import(fds)
        i = 0
        for ag in r.groups:
            g = GroupRecord(id=ag.id, tenant=t.id, n_regions=ag.n_regions,
                            npages=ag.capacity // self.page_size, bases=list(ag.bases),
                            label=ag.label, chunk_units=ag.chunk_units)
            for u in ag.units:
                self.ledger.adopt(t, g, u, pages[i:i + ag.n_regions])
                i += ag.n_regions
            g.record_usage(ag.in_use, ag.reserve)
            t.groups[g.id] = g
            self.groups[g.id] = g
        lease = -(-r.lease // self.page_size)
        self.ledger.lease(t, lease, adopted=True)
        self.recovery.returned(t.pid)
        log.info("tenant %d (%s, pid %d) adopted: %d groups, %d pages, lease %d pages",
                 t.id, t.name, t.pid, len(r.groups), t.granted, lease)
        return p.Adopted(id=r.id, groups=[g.id for g in r.groups], pages=t.granted)
