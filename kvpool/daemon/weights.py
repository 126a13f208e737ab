"""Weight sets: pages of the pool shared read-only by every tenant that opens the same
checkpoint (docs/ARCHITECTURE.md, "Weight sets").

A set is named by its content key (:data:`kvpool.protocol.WeightKey`, derived by the
client from the checkpoint's tensor bytes) and lives through two states:

* ``loading`` — created by one tenant (``WeightCreate``), which alone holds it, maps its
  pages writable and loads the tensors. Nobody else can see it: an attach of its key is
  ``NOT_FOUND``, the same as for a key nobody created. When the creator detaches or its
  session ends before sealing, the set is dropped and its pages return.
* ``sealed`` — the creator unmapped its writable mappings and sent ``WeightSeal``: every
  page is read-only for good (``Backend.seal_read_only``; on a backend without seals
  the state change itself) and any tenant of its scope may attach it (``WeightAttach``:
  the descriptors, mapped read-only).

Scope: a set is attachable by tenants of its creator's uid, and by everyone when an
admin identity created it on a backend that seals for good (``caps.read_only_shares``,
host; :meth:`WeightSets.scope_of`, :meth:`WeightSets.visible`); another uid's set of
the same key is invisible (``NOT_FOUND``), since a key derived from public bytes proves
nothing about what its creator loaded. Two uids of one checkpoint hold two copies unless
an admin loads it. A backend whose pages can only be *mapped* read-only
(``caps.read_only_maps`` without ``read_only_shares``: CUDA) has sets too, "sealed" by
the state change alone, but scoped to the creator's uid even for an admin: within a
uid a holder could write the others' memory anyway; across uids only a real seal
protects.

Accounting: a set's pages are taken from the pool once (``Pool.take_sealable``, owned in
the pool by the set's negative id), so the budget counts them once however many hold
it. Each holder's ``max`` counts the whole set (``TenantRecord.weight_pages``): attaching
never lets a tenant exceed its max. A held set is never reclaimed; its pages are left
out of the budget the fair-share policy divides (:attr:`pinned_pages`). A sealed set
nobody holds stays *cached* (a restart attaches it without loading) and is the first
memory reclaimed under pressure (:meth:`evict`, called by the reclaimer before it asks
any tenant), least recently held first. Each creator uid caches at most
:data:`MAX_CACHED_PER_UID` sets, and a create that finds :data:`MAX_SETS` taken evicts a
cached set first: only held or loading sets can keep a create out.

Dropped sets: a set's pages that anyone keeps after it is dropped (descriptors, mappings,
a forked child's) are charged to its creator's :class:`Payer` (uid, configured name),
as an ended session's retained pages are (``Pool.ended`` on the set's owner id): they
count against that uid's ``max`` and show in ``ps``'s retained by uid.

Mutable sets (``WeightCreate`` with ``mutable``): two buffers, one writer, read-only
readers and a version fence between them (:mod:`kvpool.daemon.weight_fence`): sealed
against later writable mappings only (``Pool.seal_writer``), state ``mutable``,
attachable like a sealed set (at the current version), never cached (dropped when its
last holder lets go).

Limitation of this slice: sets are not part of the restart state; after a daemon restart
they are gone (holders keep their mappings, no longer counted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from kvpool import protocol as p
from kvpool.daemon.ledger import Ledger
from kvpool.daemon.outcome import Fail, Outcome, Sender
from kvpool.daemon.pool import Payer, Pool, PoolExhausted
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord, Tenants
from kvpool.daemon.weight_fence import BUFFERS, Fence
from kvpool.vmm import VmmError

log = logging.getLogger("kvpool.daemon.weights")

ADMIN_SCOPE = -1  # the scope of sets an admin identity created: visible to every uid
MAX_SETS = 256  # weight sets in the pool, at most (a tenant could otherwise flood it)
MAX_HELD = 16  # sets one tenant may hold at once
MAX_CACHED_PER_UID = 16  # cached sets (held by nobody) of one creator uid, at most
KEY_SHOWN = 12  # hex digits of a key that ps shows


@dataclass(eq=False)
class WeightSet:
    id: int
    key: str
    nbytes: int  # asked (of each buffer, for a mutable set)
    pfns: list[int]
    creator: int  # tenant id
    scope: int  # who may attach it: the creator's uid, or ADMIN_SCOPE
    payer: Payer  # who pays for its pages kept after it is dropped: its creator's uid
    state: p.WeightSetState = "loading"  # then "sealed"
    holders: set[int] = field(default_factory=set)  # tenant ids
    idle_since: float = 0.0  # monotonic: when its last holder let go
    fence: Fence | None = None  # a mutable set's (kvpool.daemon.weight_fence)

    @property
    def owner(self) -> int:
        """Its id in ``Pool.owner`` (negative: no tenant id is)."""
        return -self.id

    @property
    def pages(self) -> int:
        return len(self.pfns)


#: ``wait(t, sender, req, pages)``: queue a create that does not fit behind reclaim, like
#: a grant (the Outcome of a deferred request), or None when ``t`` is not entitled to
#: take memory from others (the create is then refused ``NO_MEMORY``).
WaitForRoom = Callable[[TenantRecord, Sender, p.WeightCreate, int], "Outcome | None"]


class WeightSets:
    """The weight sets over ``pool``, held by ``tenants``, their pages moved (and the
    moves recorded) through ``ledger`` (a ledger of ``pool`` alone when not given);
    ``owed()`` is how many free pages waiting grants are owed (a new set does not take
    them); ``wait`` queues a create that does not fit behind reclaim
    (:data:`WaitForRoom`; served later by :meth:`serve`)."""

    def __init__(self, pool: Pool, tenants: Tenants, owed: Callable[[], int],
                 wait: WaitForRoom | None = None, max_sets: int = MAX_SETS,
                 max_cached_per_uid: int = MAX_CACHED_PER_UID, ledger: Ledger | None = None):
        self.max_sets = max_sets
        self.max_cached_per_uid = max_cached_per_uid
        self.ledger = ledger if ledger is not None else Ledger(pool)
        self.pool = pool
        self.page_size = pool.page_size
        self.tenants = tenants
        self.owed = owed
        self.wait = wait
        self.sets: dict[tuple[int, str], WeightSet] = {}  # (scope, key) -> set
        self.by_id: dict[int, WeightSet] = {}
        self._next_id = 1

    # ---- accounting (the reclaimer's and views' inputs) ----------------------------------
    @property
    def pages(self) -> int:
        return sum(s.pages for s in self.sets.values())

    @property
    def pinned_pages(self) -> int:
        """Pages of sets that cannot be reclaimed now: loading, or held."""
        return sum(s.pages for s in self.sets.values() if s.holders)

    @property
    def cached_pages(self) -> int:
        return self.pages - self.pinned_pages

    def cached(self, uid: int | None = None) -> list[WeightSet]:
        """Sealed sets nobody holds (of creator uid ``uid``, or all), least recently
        held first."""
        return sorted((s for s in self.sets.values() if not s.holders
                       and (uid is None or s.payer.uid == uid)), key=lambda s: s.idle_since)

    def evict(self, pages: int) -> int:
        """Drop sealed sets nobody holds, least recently held first, until ``pages``
        pages are back (or none is left). Returns the pages freed."""
        freed = 0
        for s in self.cached():
            if freed >= pages:
                break
            freed += s.pages
            self._evict(s, "reclaimed")
        return freed

    def holds(self, tenant: int, pfn: int) -> bool:
        """Whether tenant id ``tenant`` holds a set with page ``pfn`` (its descriptors
        may be sent to it: ``FdSender``)."""
        owner = self.pool.owner.get(pfn, 0)
        s = self.by_id.get(-owner) if owner < 0 else None
        return s is not None and tenant in s.holders

    def held_by(self, t: TenantRecord) -> list[WeightSet]:
        return [s for s in self.sets.values() if t.id in s.holders]

    def sole_pages(self, t: TenantRecord) -> int:
        """Pages of the sets ``t`` alone holds: what would come back (be cached, then
        evictable) if it let go of every set; a set another tenant holds too stays."""
        return sum(s.pages for s in self.sets.values() if s.holders == {t.id})

    def keys_of(self, t: TenantRecord) -> list[str]:
        return [s.key[:KEY_SHOWN] for s in self.held_by(t)]

    # ---- requests ------------------------------------------------------------------
    def create(self, t: TenantRecord, sender: Sender, r: p.WeightCreate) -> Outcome:
        self._require_holder(t, "weight_create")
        if not self.pool.backend.caps.read_only_maps:
            raise Fail(p.BAD_REQUEST, f"the {self.pool.backend.name} backend cannot map "
                                      "pages read-only: no weight sets")
        scope = self.scope_of(t)
        if (scope, r.key) in self.sets:
            s = self.sets[(scope, r.key)]
            raise Fail(p.BUSY, "this weight set exists: attach it" if s.state == "sealed"
                       else "this weight set is being loaded by another tenant")
        n = -(-r.nbytes // self.page_size) * (BUFFERS if r.mutable else 1)
        self._admit(t, n, "create")
        self._make_count_room()
        self.evict(n + self.owed() - self.pool.available)
        if n > self.pool.available - self.owed():
            waiting = self.wait(t, sender, r, n) if self.wait is not None else None
            if waiting is not None:  # reclaim asks others; served by serve() later
                return waiting
            raise Fail(p.NO_MEMORY, f"a weight set of {n} pages does not fit: "
                                    f"{self.pool.available} pages available")
        return self._create_now(t, r, n)

    def serve(self, t: TenantRecord, r: p.WeightCreate, n: int) -> Outcome:
        """A create that waited for reclaim, its ``n`` pages free now: checked again (a
        set of its key may exist by now, its limits may have changed), then made."""
        try:
            scope = self.scope_of(t)
            if (scope, r.key) in self.sets:
                raise Fail(p.BUSY, "this weight set was created while the request waited: "
                                   "attach it")
            self._admit(t, n, "create")
            self._make_count_room()
            return self._create_now(t, r, n)
        except Fail as e:
            return Outcome(p.error(r.id, e.code, str(e)), tenant=t)

    def _create_now(self, t: TenantRecord, r: p.WeightCreate, n: int) -> Outcome:
        scope = self.scope_of(t)
        sid = self._next_id
        try:
            pfns = self.ledger.take_set(t, n, -sid, r.key[:KEY_SHOWN])
        except PoolExhausted as e:
            raise Fail(p.NO_MEMORY, str(e)) from e
        self._next_id += 1
        s = WeightSet(id=sid, key=r.key, nbytes=r.nbytes, pfns=pfns, creator=t.id,
                      scope=scope, payer=t.payer, holders={t.id},
                      fence=Fence(writer=t.id) if r.mutable else None)
        self.sets[(scope, r.key)] = s
        self.by_id[sid] = s
        return self._granted(t, r.id, s)

    def seal(self, t: TenantRecord, sender: Sender, r: p.WeightSeal) -> p.Reply:
        s = self._held(t, r.key)
        if s is None:
            raise Fail(p.NOT_FOUND, "this session holds no such weight set")
        if s.state != "loading" or s.creator != t.id:
            raise Fail(p.BAD_REQUEST, "the weight set is sealed already")
        try:
            if s.fence is not None:  # the writer's mappings stay writable
                self.pool.seal_writer(s.pfns)
            else:
                self.pool.seal(s.pfns)
        except VmmError as e:
            raise Fail(p.BUSY, f"cannot seal the weight set: {e}") from e
        if s.fence is not None:
            s.state = "mutable"
            s.fence.sealed()
        else:
            s.state = "sealed"
        self.ledger.record_set(t, s.pages, "seal", s.key[:KEY_SHOWN])
        return p.Done(id=r.id)

    def attach(self, t: TenantRecord, sender: Sender, r: p.WeightAttach) -> Outcome:
        self._require_holder(t, "weight_attach")
        if r.write:
            raise Fail(p.UNAUTHORIZED, "a weight set is attached read-only")
        s = self.visible(t, r.key)
        if s is None or s.state == "loading":  # a loading set is nobody else's business
            raise Fail(p.NOT_FOUND, "no sealed weight set has this key")
        if t.id in s.holders:
            raise Fail(p.BAD_REQUEST, "this session holds the weight set already")
        self._admit(t, s.pages, "attach")
        s.holders.add(t.id)
        if s.fence is not None:
            s.fence.attached(t.id)
        self.ledger.hold_set(t, s.pages, s.key[:KEY_SHOWN])
        return self._granted(t, r.id, s)

    def detach(self, t: TenantRecord, sender: Sender, r: p.WeightDetach) -> p.Reply:
        s = self._held(t, r.key)
        if s is None:
            raise Fail(p.NOT_FOUND, "this session holds no such weight set")
        self._let_go(t, s)
        return p.Done(id=r.id)

    # ---- a mutable set's fence (kvpool.daemon.weight_fence) ------------------------------
    def write(self, t: TenantRecord, sender: Sender, r: p.WeightWrite) -> p.Reply:
        reply = self._fence(t, r.key).begin_write(t.id)
        reply.id = r.id
        return reply

    def publish(self, t: TenantRecord, sender: Sender, r: p.WeightPublish) -> p.Reply:
        reply = self._fence(t, r.key).publish(t.id)
        reply.id = r.id
        self.ledger.record_set(t, 0, "publish", r.key[:KEY_SHOWN])
        return reply

    def use(self, t: TenantRecord, sender: Sender, r: p.WeightUse) -> p.Reply:
        reply = self._fence(t, r.key).use(t.id, r.version)
        reply.id = r.id
        return reply

    def _fence(self, t: TenantRecord, key: str) -> Fence:
        s = self._held(t, key)
        if s is None:
            raise Fail(p.NOT_FOUND, "this session holds no such weight set")
        if s.fence is None:
            raise Fail(p.BAD_REQUEST, "the weight set is not mutable")
        return s.fence

    def dropped(self, t: TenantRecord) -> None:
        """``t``'s session ended: it holds nothing any more; a set it was loading goes."""
        for s in self.held_by(t):
            self._let_go(t, s)

    # ---- helpers --------------------------------------------------------------------
    def visible(self, t: TenantRecord, key: str) -> WeightSet | None:
        """The set ``key`` that ``t`` may attach: one its own uid created, else one an
        admin identity created. Another uid's set is invisible: a content key is
        computed from public bytes, so anyone could create a set under a popular
        checkpoint's key and load something else into it; a tenant trusts only its own
        uid's loads and the admins'."""
        own = self.sets.get((self.scope_of(t), key))
        if own is not None and own.state != "loading":
            return own
        return self.sets.get((ADMIN_SCOPE, key)) or own

    @property
    def shared_across_uids(self) -> bool:
        """Whether an admin's sets are visible to every uid: only when sealing makes
        pages read-only for good (``caps.read_only_shares``, host). Without a seal
        (CUDA) a read-only mapping is each holder's own choice: a holder of another uid
        could map the pages writable and change what every uid computes with, so an
        admin's set is scoped to the admin's uid like anyone's."""
        return self.pool.backend.caps.read_only_shares

    def scope_of(self, t: TenantRecord) -> int:
        """The scope of the sets ``t`` creates: :data:`ADMIN_SCOPE` for an admin
        identity where sets are sealed for good, else ``t``'s uid. Within one uid the
        holders' read-only mappings are enough: processes of one uid can write each
        other's memory anyway (ptrace, ``/proc/PID/mem``)."""
        return ADMIN_SCOPE if t.admin and self.shared_across_uids else t.uid

    def _held(self, t: TenantRecord, key: str) -> WeightSet | None:
        return next((s for s in self.held_by(t) if s.key == key), None)

    @staticmethod
    def _require_holder(t: TenantRecord, op: str) -> None:
        if t.kind in NO_MEMORY_KINDS:
            raise Fail(p.UNAUTHORIZED, f"a {t.kind} session holds no memory ({op} refused)")

    def _admit(self, t: TenantRecord, n: int, op: str) -> None:
        """One clear refusal for a set that can never fit: past the budget, or past the
        tenant's max (its KV, lease, waiting pages and other sets count)."""
        budget = self.pool.budget_pages
        if n > budget:
            raise Fail(p.OVER_LIMIT, f"a weight set of {n} pages is larger than the budget "
                                     f"of {budget} pages")
        if len(self.held_by(t)) >= MAX_HELD:
            raise Fail(p.OVER_LIMIT, f"a tenant may hold at most {MAX_HELD} weight sets")
        have = t.held + t.waiting_pages + t.weight_pages
        kept = self.pool.charged(t.id, t.payer)  # (a dropped set's kept pages too)
        if have + kept + n > t.cap_pages and self.pool.settle_ended(t.payer):
            kept = self.pool.charged(t.id, t.payer)  # only what is still referenced
        if have + kept + n > t.cap_pages:
            why = (f" ({kept} of them released pages that uid {t.uid} has kept open or "
                   f"mapped)" if kept else "")
            raise Fail(p.OVER_LIMIT, f"{t.name}: a weight set of {n} pages on top of the "
                                     f"{have + kept} it holds would exceed its limit of "
                                     f"{t.cap_pages} pages ({op} refused){why}")

    def _make_count_room(self) -> None:
        """Room for one more set under ``max_sets``: the least recently held cached set
        goes; refused (``OVER_LIMIT``) only when every set is held or loading."""
        if len(self.sets) < self.max_sets:
            return
        cached = self.cached()
        if not cached:
            raise Fail(p.OVER_LIMIT, f"the pool holds {self.max_sets} weight sets already, "
                                     f"every one of them held")
        self._evict(cached[0], f"evicted (the pool holds {self.max_sets} sets)")

    def _trim_cached(self, uid: int) -> None:
        """Uid ``uid`` caches at most ``max_cached_per_uid`` sets: its least recently
        held ones beyond go (one uid's cache never crowds out the others')."""
        cached = self.cached(uid)
        for s in cached[:max(0, len(cached) - self.max_cached_per_uid)]:
            self._evict(s, f"evicted (uid {uid} caches {self.max_cached_per_uid} sets)")

    def _evict(self, s: WeightSet, why: str) -> None:
        log.info("weight set %s %s (%d pages, cached, nobody held it)", s.key[:KEY_SHOWN],
                 why, s.pages)
        self._drop(s, "evict")

    def _granted(self, t: TenantRecord, rid: int, s: WeightSet) -> Outcome:
        reply = p.WeightGranted(id=rid, group=0, units=[], nfds=s.pages, key=s.key,
                                state=s.state, nbytes=s.nbytes,
                                version=s.fence.version if s.fence is not None else 0)
        return Outcome(reply, pfns_to_send=list(s.pfns), tenant=t)

    def _let_go(self, t: TenantRecord, s: WeightSet) -> None:
        s.holders.discard(t.id)
        if s.fence is not None:
            s.fence.let_go(t.id)  # the writer's: its unpublished write is lost
        self.ledger.let_go_set(t, s.pages, s.key[:KEY_SHOWN])
        if s.state == "loading":  # never sealed: never attachable, its pages return
            log.info("weight set %s dropped before it was sealed", s.key[:KEY_SHOWN])
            self._drop(s, "discard")
        elif s.fence is not None and not s.holders:  # nobody can write it again
            self._drop(s, "discard")
        elif not s.holders:
            s.idle_since = time.monotonic()
            self._trim_cached(s.payer.uid)

    def _drop(self, s: WeightSet, op: str) -> None:
        """``s`` goes (recorded as ``op``): its pages back, what anyone kept of them
        charged to its creator's uid."""
        holders = [h for h in map(self.tenants.by_id.get, s.holders) if h is not None]
        s.holders.clear()  # (only a loading set's creator, when it dies)
        del self.sets[(s.scope, s.key)]
        del self.by_id[s.id]
        self.ledger.drop_set(s.pfns, s.owner, s.payer, holders, op, s.key[:KEY_SHOWN])

    # ---- integrity ------------------------------------------------------------------
    def check(self, seen: set[int]) -> list[str]:
        """Each set's pages are owned by it in the pool (added to ``seen``), holders
        are live tenants and count exactly the sets they hold."""
        problems: list[str] = []
        for s in self.sets.values():
            for pfn in s.pfns:
                if pfn in seen:
                    problems.append(f"pfn {pfn} of weight set {s.id} is also elsewhere")
                seen.add(pfn)
                if self.pool.owner.get(pfn) != s.owner:
                    problems.append(f"pfn {pfn} of weight set {s.id} is owned by "
                                    f"{self.pool.owner.get(pfn)} in the pool")
            gone = [h for h in s.holders if h not in self.tenants.by_id]
            if gone:
                problems.append(f"weight set {s.id} is held by dead tenants {gone[:8]}")
            if s.state == "loading" and s.holders != {s.creator}:
                problems.append(f"weight set {s.id} is loading but held by {sorted(s.holders)}")
            if s.fence is not None:
                problems += [f"weight set {s.id}: {m}" for m in s.fence.check(s.holders)]
        for t in self.tenants:
            want = sum(s.pages for s in self.held_by(t))
            if t.weight_pages != want:
                problems.append(f"tenant {t.id} counts {t.weight_pages} weight pages, its "
                                f"sets hold {want}")
        return problems
