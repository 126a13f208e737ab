"""Reclaim: requests that wait for memory, and what the daemon asks tenants to give back.

When a grant (or a lease) does not fit, the requester becomes a :class:`Waiter` with a
deadline and the daemon reclaims, cheapest first:

a. its warm pool and dirty pages (already counted in ``Pool.available``: free for the taking),
   and cached memory nobody holds (weight sets no tenant holds: :class:`Evictable`,
   dropped at once, before any tenant is asked);
b. tenants' reserves — an :class:`Ask` in mode ``reserve`` for mapped-but-unused units,
   never below the tenant's ``min``;
c. tenants above their share under the reclaim policy (:mod:`kvpool.daemon.policy`;
   the default ``fair_share`` is weighted max-min fairness),
   never below ``max(min, share)`` — an :class:`Ask` in mode ``shrink``: the tenant's shrink
   callback frees cached blocks so whole units empty, and the library releases them;
d. when b and c leave pages missing (nobody else to ask, or the asked answered short):
   ONE idle tenant that opted in is asked to sleep (:class:`SleepSource`,
   :mod:`kvpool.daemon.sleepers`): it releases all its KV and its weight-set holds. It
   is credited only with what that frees (a set another tenant holds stays), never
   chosen when that is nothing, and the one that frees all that is missing first.

A tenant above its hard limit (``max`` lowered by an admin) gets an urgent shrink ask for
the excess at once, idle or not. Every ask has a deadline; a tenant that lets one expire
is counted (``ignored``) and marked unresponsive: capped at its ``min`` until it answers a
reclaim, so memory it releases above ``min`` does not come back. Until then nothing is
counted on from it: later rounds still ask it for all it holds above its floor (so
that it can answer), but plan as if it gave nothing (its ask is not in
:attr:`Reclaimer.asked_pages`, its claim keeps what it holds), so the other tenants are
asked and an idle one is put to sleep (d.): a hung tenant cannot block reclaim.

Invariants: at most one outstanding ask per tenant; waiters are served strictly in
arrival order among themselves (freed pages go to the oldest waiter); a newcomer takes
free memory past the waiters only when it fits now and keeps the newcomer within its
fair share (``Grants.fits``: no head-of-line blocking — the waiter's missing pages
are then asked for at the next step); a waiter is answered exactly once (granted, or
``NO_MEMORY``/``OVER_LIMIT`` at its deadline): a waiter taken off the queue goes to
:attr:`Reclaimer.done` at once, where the arbiter takes it even when the rest of the
step raised (a bug), so no waiter is ever lost between the queue and its answer.
Pure bookkeeping over the tenants' records and the pool's free count: no sockets, no
clocks of its own (``now`` is passed in), so it is testable alone. Asks leave through
the :class:`~kvpool.daemon.outcome.Outbox`; an observer (:mod:`kvpool.daemon.hooks`)
hears of each ask and of what asked tenants give back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AbstractSet, Protocol

from kvpool import protocol as p
from kvpool.daemon.fairshare import Claim
from kvpool.daemon.hooks import NoObserver, ReclaimObserver
from kvpool.daemon.outcome import Outbox
from kvpool.daemon.policy import FairShare, ReclaimPolicy
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import Ask, TenantRecord, Tenants

__all__ = ["Ask", "Reclaimer", "Waiter"]

log = logging.getLogger("kvpool.daemon.reclaim")
daemon_log = logging.getLogger("kvpool.daemon")


# A tenant that answered a shrink short is not asked again for ``short_backoff_s``
# (Config; others are asked first): short enough that a waiter does not sit out most of
# its deadline behind one round.


class Evictable(Protocol):
    """Memory in the pool that no tenant holds and the daemon may drop on its own (the
    cached weight sets, :class:`kvpool.daemon.weights.WeightSets`), and memory no tenant
    can be asked for (held sets). The reclaimer evicts before it asks any tenant."""

    @property
    def pinned_pages(self) -> int:
        """Pages counted in the pool's ``granted`` that no tenant's ``held`` includes
        and that cannot be reclaimed now: the fair-share policy divides the budget
        less these."""
        ...

    def evict(self, pages: int) -> int:
        """Drop cached memory until ``pages`` pages are back in the pool (given back:
        ``Pool.available`` grows by what this returns); returns how many were."""
        ...


class SleepSource(Protocol):
    """Tenants the daemon may put to sleep (:class:`kvpool.daemon.sleepers.SleepBook`)."""

    def put_one_to_sleep(self, spare: AbstractSet[int], need: int,
                         now: float) -> TenantRecord | None:
        """Waiting grants miss ``need`` pages beyond the memory free and the asks
        counted on: ask at most one tenant (never one whose id is in ``spare``, the
        waiters') whose sleep frees something to sleep, the one that frees ``need``
        first, unless one was asked already and has not answered. Returns the tenant
        asked, or None. Called at every reclaim step that still misses pages: it must
        be cheap and must not ask twice."""
        ...

    def could_free(self, spare: AbstractSet[int], need: int, now: float) -> int:
        """Pages the sleep of the tenant :meth:`put_one_to_sleep` would choose for
        ``need`` would give back (its KV, and only the weight sets nobody else holds);
        0 when it would ask nobody. Read-only."""
        ...


def counted_ask(t: TenantRecord) -> int:
    """The pages of ``t``'s outstanding ask that reclaim counts on: none when it has
    none, or when it is unresponsive (it ignored its last ask)."""
    return t.ask.pages if t.ask is not None and not t.unresponsive else 0


class NoSleep:
    """Nobody is ever put to sleep (the default)."""

    def put_one_to_sleep(self, spare: AbstractSet[int], need: int,
                         now: float) -> TenantRecord | None:
        return None

    def could_free(self, spare: AbstractSet[int], need: int, now: float) -> int:
        return 0


class NoCache:
    """No evictable memory (the default)."""

    pinned_pages = 0

    def evict(self, pages: int) -> int:
        return 0


@dataclass(eq=False)
class Waiter:
    """A grant or lease growth queued until ``pages`` are free (or ``deadline``)."""

    tenant: TenantRecord
    envelope: list[bytes]
    req: p.Request  # p.Grant or p.Lease
    pages: int
    deadline: float
    # one rank's part of a gang's grant (kvpool.daemon.gangs): the gang serves it with
    # its other ranks' (when :meth:`Reclaimer.covers` holds on every device) and fails
    # it at its deadline; :meth:`Reclaimer.step` only sets its pages aside, in order
    collective: bool = False


class Reclaimer:
    """Waiters and asks over ``tenants``, for pages of ``pool`` within ``budget`` bytes;
    asks are queued in ``outbox``; ``policy`` decides shares, who gives back and who
    may grow by reclaim; ``cache`` is evicted before any tenant is asked; ``sleep`` puts
    an idle tenant to sleep when asking leaves pages missing."""

    def __init__(self, tenants: Tenants, pool: Pool, budget: int, outbox: Outbox,
                 timeout_s: float, short_backoff_s: float = 0.5,
                 policy: ReclaimPolicy | None = None, cache: Evictable | None = None,
                 sleep: SleepSource | None = None):
        self.tenants = tenants
        self.sleep: SleepSource = sleep if sleep is not None else NoSleep()
        self.cache: Evictable = cache if cache is not None else NoCache()
        self.policy: ReclaimPolicy = policy or FairShare()
        self.pool = pool
        self.page_size = pool.page_size
        self.budget = budget
        self.outbox = outbox
        self.observer: ReclaimObserver = NoObserver()
        self.timeout_s = timeout_s
        self.short_backoff_s = short_backoff_s
        self.waiters: list[Waiter] = []
        # taken off the queue, not yet answered: (waiter, None) to serve, or its error
        self.done: list[tuple[Waiter, p.Reply | None]] = []
        self._seq = 0

    def observe(self, observer: ReclaimObserver) -> None:
        """Report asks and what asked tenants give back to ``observer``."""
        self.observer = observer

    # ---- bookkeeping ---------------------------------------------------------------
    @property
    def shared_budget(self) -> int:
        """The bytes the policy divides: the budget less held weight sets (pinned)."""
        return max(0, self.budget - self.cache.pinned_pages * self.page_size)

    def make_room(self, pages: int) -> None:
        """Evict cached memory so that ``pages`` more fit beside what waiters are owed."""
        short = pages + self.waiting_pages - self.pool.available
        if short > 0:
            self.cache.evict(short)

    @property
    def waiting_pages(self) -> int:
        return sum(w.pages for w in self.waiters)

    @property
    def asked_pages(self) -> int:
        """Pages asked for and counted on (not an unresponsive tenant's: it may never
        answer)."""
        return sum(counted_ask(t) for t in self.tenants)

    def wait(self, t: TenantRecord, envelope: list[bytes], req: p.Request, pages: int, now: float,
             collective: bool = False) -> Waiter:
        w = Waiter(t, envelope, req, pages, now + self.timeout_s, collective)
        self.waiters.append(w)
        t.waiting_pages += pages
        return w

    def covers(self, w: Waiter) -> bool:
        """Whether the free pages cover waiter ``w`` after every waiter queued before it
        (what :meth:`step` sets aside for a collective waiter). Read-only."""
        ahead = 0
        for x in self.waiters:
            if x is w:
                return ahead + w.pages <= self.pool.available
            ahead += x.pages
        return False

    def withdraw(self, w: Waiter) -> None:
        """``w`` is answered by its owner (a gang's part): no longer waiting here."""
        if w in self.waiters:
            self._pop(w)

    def released(self, t: TenantRecord, pages: int) -> None:
        """``t`` gave back ``pages``: they count towards its outstanding ask."""
        ask = t.ask
        if ask is not None:
            ask.pages -= pages
            self.observer.gave_back(t, pages, ask.mode)

    def answered(self, t: TenantRecord, seq: int, now: float) -> None:
        """The tenant finished handling reclaim ``seq`` (a :class:`~p.Reclaimed`)."""
        ask = t.ask
        if ask is None or ask.seq != seq:
            return
        if ask.pages > 0 and ask.mode == "shrink":
            t.short_until = now + min(self.timeout_s, self.short_backoff_s)  # ask others first
        t.ask = None
        t.unresponsive = False

    def forget(self, t: TenantRecord) -> list[Waiter]:
        """``t`` is gone: its waiters are dropped (nobody to answer)."""
        gone = [w for w in self.waiters if w.tenant is t]
        self.waiters = [w for w in self.waiters if w.tenant is not t]
        t.waiting_pages = 0
        return gone

    # ---- policy inputs ------------------------------------------------------------------
    def claims(self, extra: tuple[TenantRecord, int] | None = None, protect: AbstractSet[int] = frozenset()
               ) -> list[Claim]:
        """Every arbitrated tenant as the fair-share policy sees it (bytes). ``extra``
        adds a request's pages to a tenant's demand; tenants in ``protect`` (ids) are
        pinned at what they hold (their floor is raised to it)."""
        ps = self.page_size
        out = []
        for t in self.tenants:
            if not t.arbitrated:
                continue
            held = max(t.held - counted_ask(t), 0)
            demand = held + t.waiting_pages + (extra[1] if extra and extra[0] is t else 0)
            floor = max(t.min_pages, t.lease_pages)  # a lease is never reclaimed
            if t.id in protect:
                floor = max(floor, held)
            out.append(Claim(name=str(t.id), held=held * ps, demand=demand * ps,
                             min=floor * ps, max=t.cap_pages * ps, shares=t.shares))
        return out

    def fair_shares(self) -> dict[int, int]:
        """Each arbitrated tenant's fair share under the policy now (bytes), by tenant id."""
        got = self.policy.fair_shares(self.shared_budget, self.claims(), self.page_size)
        return {int(k): v for k, v in got.items()}

    def may_grow(self, t: TenantRecord, pages: int, lease: bool = False) -> bool:
        """Whether ``t`` may take ``pages`` more by reclaiming from others: up to its fair
        share; a lease may take everything above the others' floors (``min``, leases)."""
        ps = self.page_size
        if lease:
            floors = sum(max(x.min_pages, x.lease_pages) for x in self.tenants
                         if x.arbitrated and x is not t)
            return t.held + t.waiting_pages + pages <= self.shared_budget // ps - floors
        return self.policy.may_grow(self.shared_budget, self.claims(extra=(t, pages)), str(t.id),
                                    pages * ps, ps)

    def lease_room(self, t: TenantRecord) -> str:
        """Why a lease of ``t`` cannot grow past what :meth:`may_grow` allows: the pages
        it may hold, the weight sets in use and the others' floors (min, leases), by
        name. Its shares play no part (said so: raising them would change nothing)."""
        ps = self.page_size
        floors = {x.name: max(x.min_pages, x.lease_pages) for x in self.tenants
                  if x.arbitrated and x is not t and max(x.min_pages, x.lease_pages)}
        room = max(0, self.shared_budget // ps - sum(floors.values()) - t.held
                   - t.waiting_pages)
        held = ", ".join(f"{n} {k}" for n, k in sorted(floors.items(), key=lambda x: -x[1]))
        return (f"a lease may take {room} pages more here: the budget of "
                f"{self.budget // ps} pages less {self.cache.pinned_pages} pages of weight "
                f"sets in use, less {sum(floors.values())} pages the others are guaranteed "
                f"(their min and leases{': ' + held if held else ''}); a lease takes "
                f"memory down to those floors whatever its shares")

    def sleep_would_cover(self, t: TenantRecord, pages: int, now: float) -> bool:
        """Whether putting one idle tenant to sleep (not ``t``, not a waiter) would free
        enough, with the memory free beyond the waiters', for ``pages`` more for ``t``:
        a request past its fair share then waits for that instead of being refused."""
        spare = {w.tenant.id for w in self.waiters} | {t.id}
        free = self.pool.available - self.waiting_pages
        freed = self.sleep.could_free(spare, pages - free, now)
        return freed > 0 and free + freed >= pages

    # ---- the step ---------------------------------------------------------------------
    def step(self, now: float) -> None:
        """Take what fits and what is late off the queue (into :attr:`done`), then ask
        for what is missing. The caller must then :meth:`take_done` and answer each,
        also when this raised."""
        done = self.done
        self._expire_asks(now)
        self.make_room(0)  # cached weight sets go before anyone is asked
        avail = self.pool.available
        for w in list(self.waiters):
            if w.collective:  # served by its gang (covers); its pages set aside meanwhile
                if w.pages > avail:
                    break
                avail -= w.pages
                continue
            if w.tenant.held + w.tenant.weight_pages + w.pages > w.tenant.cap_pages:
                self._pop(w)
                done.append((w, p.error(w.req.id, p.OVER_LIMIT, f"{w.tenant.name}: its limit "
                                        f"changed while the request waited")))
                continue
            if w.pages > avail:
                break
            self._pop(w)
            avail -= w.pages
            done.append((w, None))
        for w in [w for w in self.waiters if w.deadline <= now and not w.collective]:
            self._pop(w)
            done.append((w, p.error(w.req.id, p.NO_MEMORY,
                                    f"{w.pages} pages not freed within {self.timeout_s:g} s "
                                    f"(reclaim deadline)")))
        self._enforce_limits(now)
        need = self.waiting_pages - avail - self.asked_pages
        if need > 0:
            self._ask(need, self.waiting_pages - avail, now)

    def take_done(self) -> list[tuple[Waiter, p.Reply | None]]:
        """The waiters :meth:`step` took off the queue, in order: ``(waiter, None)`` to
        be served now, or ``(waiter, error reply)``; the caller answers every one."""
        done, self.done = self.done, []
        return done

    def _ask(self, need: int, missing: int, now: float) -> None:
        """One ask per tenant per round: its reserve first (cheap), plus a shrink when
        reserves do not cover ``need`` (``missing`` less the asks counted on); when
        they do not either, one idle tenant sleeps, chosen by what it frees towards
        ``missing``, all the waiters miss (asks may come back short). Asking a tenant
        for its reserve alone and only then for more would let a busy tenant, whose
        reserve refills as requests finish, answer reserve asks forever while the
        waiter starves."""
        everyone = self._victims()
        victims = [t for t in everyone if not t.unresponsive]
        reserves = self._plan_reserve_asks(victims, need)
        rest = need - sum(reserves.values())
        shrinks = self._plan_shrink_asks(victims, rest, now) if rest > 0 else {}
        urgent = any(w.deadline - now < self.timeout_s / 2 for w in self.waiters)
        by_id = {t.id: t for t in victims}
        for tid in sorted(set(reserves) | set(shrinks)):
            pages = reserves.get(tid, 0) + shrinks.get(tid, 0)
            if tid in shrinks:
                self._send_ask(by_id[tid], pages, "shrink", urgent, "fair share", now)
            else:
                self._send_ask(by_id[tid], pages, "reserve", False, "reserve", now)
        for t in everyone:  # ignored its last ask: asked again, counted on by nobody
            excess = t.held - max(t.min_pages, t.lease_pages)
            if t.unresponsive and excess > 0:
                self._send_ask(t, excess, "shrink", urgent, "unresponsive: above its min",
                               now)
        if rest - sum(shrinks.values()) > 0:  # nobody else to ask: one idle tenant sleeps
            self.sleep.put_one_to_sleep({w.tenant.id for w in self.waiters}, missing, now)

    def _pop(self, w: Waiter) -> None:
        self.waiters.remove(w)
        w.tenant.waiting_pages -= w.pages

    def _expire_asks(self, now: float) -> None:
        for t in self.tenants:
            ask = t.ask
            if ask is None:
                continue
            if ask.pages <= 0:
                t.ask = None  # satisfied (its Reclaimed, if any, finds nothing to clear)
                t.unresponsive = False
                continue
            if ask.deadline <= now:
                t.ask = None
                if ask.pages > 0:
                    t.ignored += 1
                    t.unresponsive = t.held > t.min_pages
                    daemon_log.warning(
                        "tenant %d (%s) ignored reclaim %d (%s, %d pages still held above "
                        "the ask); capped at its min until it answers", t.id, t.name,
                        ask.seq, ask.reason, ask.pages)

    def ask(self, t: TenantRecord, pages: int, mode: p.ReclaimMode, urgent: bool,
            reason: str, now: float) -> None:
        """Ask ``t`` for ``pages`` now, outside a round (a gang's ask mirrored to its
        other ranks, :meth:`kvpool.daemon.gangs.Gangs.mirror_asks`); ``t`` has no ask."""
        self._send_ask(t, pages, mode, urgent, reason, now)

    def _send_ask(self, t: TenantRecord, pages: int, mode: p.ReclaimMode, urgent: bool,
                  reason: str, now: float) -> None:
        self._seq += 1
        log.debug("reclaim %d: %s asked for %d pages (%s%s, %s)", self._seq, t.name, pages,
                  mode, ", urgent" if urgent else "", reason)
        t.ask = Ask(self._seq, pages, mode, urgent, now + self.timeout_s, reason)
        msg = p.Reclaim(bytes=pages * self.page_size, reason=reason, seq=self._seq,
                        mode=mode, urgent=urgent, deadline_ms=int(self.timeout_s * 1000))
        self.outbox.send(t, msg)
        self.observer.asked(t, msg)

    def _enforce_limits(self, now: float) -> None:
        """Tenants above their (lowered) limit shrink now, idle or not."""
        for t in self.tenants:
            excess = t.granted - max(0, t.max_pages - t.lease_pages)
            if excess > 0 and t.ask is None and t.arbitrated:
                self._send_ask(t, excess, "shrink", True, "limit", now)

    def _victims(self) -> list[TenantRecord]:
        waiting = {w.tenant.id for w in self.waiters}
        return [t for t in self.tenants
                if t.arbitrated and t.ask is None and t.id not in waiting]

    def _plan_reserve_asks(self, victims: list[TenantRecord], need: int) -> dict[int, int]:
        plan: dict[int, int] = {}
        for t in sorted(victims, key=lambda t: -t.reserve_pages):
            if need <= 0:
                break
            spare = min(t.reserve_pages, t.held - t.min_pages)
            if spare <= 0:
                continue
            plan[t.id] = min(spare, need)
            need -= plan[t.id]
        return plan

    def _plan_shrink_asks(self, candidates: list[TenantRecord], need: int,
                          now: float) -> dict[int, int]:
        ps = self.page_size
        victims = {t.id: t for t in candidates if t.short_until <= now}
        protect = {t.id for t in self.tenants if t.id not in victims}
        plan = self.policy.plan(self.shared_budget, self.claims(protect=protect), need * ps, ps)
        asked: dict[int, int] = {}
        for name, nbytes in plan:
            if int(name) in victims:
                asked[int(name)] = -(-nbytes // ps)
        rest = need - sum(asked.values())
        if rest > 0 and any(isinstance(w.req, p.Lease) for w in self.waiters):
            # a lease shrinks everyone else down to their floors, fullest first
            for t in sorted(victims.values(), key=lambda t: -(t.held - t.min_pages)):
                spare = t.held - max(t.min_pages, t.lease_pages) - asked.get(t.id, 0)
                if rest <= 0 or spare <= 0:
                    continue
                take = min(spare, rest)
                asked[t.id] = asked.get(t.id, 0) + take
                rest -= take
        return asked

    def next_deadline(self) -> float | None:
        times = [w.deadline for w in self.waiters]
        times += [t.ask.deadline for t in self.tenants if t.ask is not None]
        return min(times) if times else None
