"""Gangs: tensor-parallel tenants whose ranks hold memory on several devices as one.

A gang is one tenant with ``N`` ranks, each rank its own session (its own process) on
its own device (docs/ARCHITECTURE.md, "Gangs"). Rank 0 creates it (:meth:`Gangs.create`,
``CreateGang``) and gets a 128-bit token; the other ranks join with it at ``Register``
(:meth:`Gangs.check_join` refuses a forged or ended token, another uid, another name, a
rank taken or out of range, a device that is not the rank's, a different layout — all
before anything is held — and :meth:`Gangs.joined` records the rank).

Grants and releases are **collective**: a rank's ``Grant``/``Release`` is a *part*,
matched with the other ranks' by (operation, group index in the layout, units). A part
waits (its answer deferred) until every rank sent the same one, then in one call:

* grant: every rank admitted (its cap); when the units fit on every device now, pages
  *reserved* on each device in turn (``Ledger.take``), any failure giving back what the
  devices before it reserved; only then *committed* to every rank's page table, each
  rank answered with its own descriptors. Every part gets ``Granted`` or every part the
  same error: no rank ever sees a partial grant;
* a grant that does not fit on some device *waits* as a single grant does (when every
  short rank may grow by reclaim: not asked to give back, within its fair share or
  covered by a sleep): a :class:`Waiting` with a *collective* waiter on every rank's
  device (:meth:`Reclaimer.wait`), so each device's reclaimer asks for its missing pages
  and sets aside the free ones in arrival order; :meth:`Gangs.serve` commits it on every
  device at once when every device covers its rank's waiter (:meth:`Reclaimer.covers`),
  :meth:`Gangs.expire` fails it at its deadline. Nothing is taken before the commit;
* release: every rank's pages of the units go back on every device together.

A part whose peers do not all come within ``timeout_s`` is answered ``NO_MEMORY``
(:meth:`Gangs.expire`); nothing was reserved for it. A rank whose session ends ends the
gang (:meth:`Gangs.dropped`): every other rank's pages go back on its device, each is
told (``GangEnded``) and refused memory from then on; its waiting parts are answered.

Answers to parts other than the one just handled (and to parts that expire) are queued
as outcomes with their envelopes (:meth:`Gangs.take_ready`); ``GangEnded`` messages in
:attr:`Gangs.outbox`; the server sends both. Each device's pieces (ledger, grants,
reclaimer) are attached by that device's arbiter (:meth:`Gangs.attach`).

Invariant (:meth:`Gangs.check`, part of ``kvpool check``): for every live gang and group
index ``k``, every rank's ``k``-th group holds exactly the same units; an ended gang's
remaining ranks hold nothing; a waiting grant belongs to a live gang and has a waiter
queued on every rank's device.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Union

from kvpool import protocol as p
from kvpool.daemon.grants import Grants, require_holder
from kvpool.daemon.ledger import Ledger
from kvpool.daemon.outcome import Fail, Outbox, Outcome, Sender
from kvpool.daemon.pool import PoolExhausted
from kvpool.daemon.reclaim import Reclaimer, Waiter
from kvpool.daemon.regions import GroupRecord
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord

log = logging.getLogger("kvpool.daemon")

Collective = Union[p.Grant, p.Release]
PartKey = tuple[str, int, tuple[int, ...]]  # (op, group index in the layout, units)


@dataclass
class GangDevice:
    """One device's pieces a gang's grant acts on (attached by that device's arbiter):
    its pages move through ``ledger``."""

    ledger: Ledger
    grants: Grants
    reclaimer: Reclaimer


@dataclass(eq=False)
class Part:
    """One rank's part of a collective grant or release, waiting for the others."""

    tenant: TenantRecord
    envelope: list[bytes]
    req: Collective
    group: GroupRecord
    deadline: float


@dataclass(eq=False)
class Waiting:
    """A gang's grant that did not fit on every device: ``waiters[rank]`` is rank's
    collective waiter on its device; served when all are covered, failed at
    ``deadline``."""

    gang: Gang
    key: PartKey
    parts: dict[int, Part]
    waiters: dict[int, Waiter]
    deadline: float


@dataclass(eq=False)
class Gang:
    id: int
    token: str
    uid: int
    name: str
    devices: list[int]  # devices[r]: rank r's device
    layout: list[tuple[int, int]]  # (n_regions, capacity) of each group, in order
    ranks: dict[int, TenantRecord] = field(default_factory=dict)  # joined, still live
    groups: dict[int, list[int]] = field(default_factory=dict)  # rank -> its group ids
    parts: dict[PartKey, dict[int, Part]] = field(default_factory=dict)  # key -> rank -> part
    ended: str = ""  # why it ended ("": it lives)
    mirrored: set[tuple[int, int]] = field(default_factory=set)  # (tenant, ask seq) done

    @property
    def size(self) -> int:
        return len(self.devices)

    def index_of(self, t: TenantRecord, gid: int) -> int:
        """The layout index of ``t``'s group ``gid``."""
        gids = self.groups.get(t.rank, [])
        if gid not in gids:
            raise Fail(p.BAD_REQUEST, f"group {gid} is not one of gang {self.id}'s")
        return gids.index(gid)


class Gangs:
    """Every gang of this daemon, over the devices attached (:meth:`attach`); parts
    wait at most ``timeout_s`` for their peers."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.devices: dict[int, GangDevice] = {}
        self.by_id: dict[int, Gang] = {}
        self.by_token: dict[str, Gang] = {}
        self.outbox = Outbox()
        self._ready: list[Outcome] = []
        self._ids = itertools.count(1)
        self.waiting: list[Waiting] = []  # grants waiting for reclaim, oldest first

    def attach(self, device: int, parts: GangDevice) -> None:
        """Device ``device``'s ledger, grants and reclaimer (its arbiter calls this)."""
        self.devices[device] = parts

    def take_ready(self) -> list[Outcome]:
        """Answers made for waiting parts (each with its envelope); the list is emptied."""
        out, self._ready = self._ready, []
        return out

    def gang_of(self, t: TenantRecord) -> Gang:
        """``t``'s gang, alive (else ``BAD_REQUEST`` naming why it ended)."""
        g = self.by_id.get(t.gang)
        if g is None:
            raise Fail(p.BAD_REQUEST, f"gang {t.gang} is gone")
        if g.ended:
            raise Fail(p.BAD_REQUEST, f"gang {g.id} ended: {g.ended}")
        return g

    # ---- creating and joining ---------------------------------------------------------
    def create(self, t: TenantRecord, sender: Sender, r: p.CreateGang) -> p.Reply:
        require_holder(t, "create_gang")
        if t.gang:
            raise Fail(p.BAD_REQUEST, f"this session is rank {t.rank} of gang {t.gang} already")
        if t.groups or t.lease_pages or t.weight_pages or t.waiting_pages:
            raise Fail(p.BAD_REQUEST, "a gang is created before its rank 0 holds anything "
                                      "(groups, lease, weight sets)")
        if len(set(r.devices)) != len(r.devices):
            raise Fail(p.BAD_REQUEST, f"devices {r.devices}: a device is named twice (one "
                                      f"rank per device)")
        if r.devices[0] != t.device:
            raise Fail(p.BAD_REQUEST, f"devices[0] is rank 0's device: this session's "
                                      f"device is {t.device}, not {r.devices[0]}")
        unserved = [d for d in r.devices if d not in self.devices]
        if unserved:
            raise Fail(p.NOT_FOUND, f"device {unserved[0]} is not served (this daemon "
                                    f"serves {', '.join(map(str, sorted(self.devices)))})")
        token = secrets.token_hex(16)
        g = Gang(id=next(self._ids), token=token, uid=t.uid, name=t.name,
                 devices=list(r.devices), layout=[(x.n_regions, x.capacity) for x in r.layout])
        g.ranks[0], g.groups[0] = t, []
        t.gang, t.rank = g.id, 0
        self.by_id[g.id] = g
        self.by_token[token] = g
        log.info("gang %d created by tenant %d (%s): %d ranks on devices %s", g.id, t.id,
                 t.name, g.size, g.devices)
        return p.GangCreated(id=r.id, gang=token, gang_id=g.id)

    def check_join(self, t: TenantRecord, r: p.Register) -> Gang | None:
        """The gang ``r`` joins (None: it joins none). Raises :class:`Fail` for any
        reason it may not; changes nothing."""
        fields = (r.gang, r.rank, r.layout)
        if all(x is None for x in fields):
            return None
        if r.gang is None or r.rank is None or r.layout is None:
            raise Fail(p.BAD_REQUEST, "gang, rank and layout come together (a rank joining "
                                      "a gang names all three)")
        if r.kind in NO_MEMORY_KINDS:
            raise Fail(p.BAD_REQUEST, f"a {r.kind} session holds no memory: it joins no gang")
        g = self.by_token.get(r.gang)
        if g is None or not secrets.compare_digest(g.token, r.gang):
            raise Fail(p.UNAUTHORIZED, "unknown gang token")
        if g.ended:
            raise Fail(p.UNAUTHORIZED, f"gang {g.id} ended: {g.ended}")
        if t.uid != g.uid:
            raise Fail(p.UNAUTHORIZED, f"gang {g.id} belongs to uid {g.uid}; this session "
                                       f"is uid {t.uid}")
        if r.name != g.name:
            raise Fail(p.UNAUTHORIZED, f"gang {g.id}'s ranks register as {g.name!r}, "
                                       f"not {r.name!r}")
        if not 1 <= r.rank < g.size:
            raise Fail(p.BAD_REQUEST, f"rank {r.rank} is outside gang {g.id} (ranks 1.."
                                      f"{g.size - 1} join; rank 0 created it)")
        if r.rank in g.ranks or r.rank in g.groups:
            raise Fail(p.BAD_REQUEST, f"rank {r.rank} of gang {g.id} has joined already")
        if r.device != g.devices[r.rank]:
            raise Fail(p.BAD_REQUEST, f"rank {r.rank} of gang {g.id} lives on device "
                                      f"{g.devices[r.rank]}, not {r.device}")
        layout = [(x.n_regions, x.capacity) for x in r.layout]
        if layout != g.layout:
            raise Fail(p.BAD_REQUEST, f"layout {_show(layout)} differs from gang {g.id}'s "
                                      f"{_show(g.layout)} (regions, bytes per unit)")
        return g

    def joined(self, g: Gang, t: TenantRecord, rank: int) -> None:
        """``t`` registered as rank ``rank`` of ``g``: it gets rank 0's knobs."""
        r0 = g.ranks.get(0)
        if r0 is not None:
            t.min_pages, t.max_pages, t.shares = r0.min_pages, r0.max_pages, r0.shares
        g.ranks[rank], g.groups[rank] = t, []
        t.gang, t.rank = g.id, rank
        log.info("tenant %d joined gang %d as rank %d on device %d", t.id, g.id, rank,
                 t.device)

    # ---- groups ---------------------------------------------------------------------
    def check_group(self, t: TenantRecord, r: p.CreateGroup) -> None:
        """A rank's next group must be the layout's next one."""
        g = self.gang_of(t)
        k = len(g.groups[t.rank])
        if k >= len(g.layout):
            raise Fail(p.BAD_REQUEST, f"gang {g.id}'s layout has {len(g.layout)} groups; "
                                      f"rank {t.rank} created them all")
        if (r.n_regions, r.capacity) != g.layout[k]:
            raise Fail(p.BAD_REQUEST, f"group {k} of gang {g.id} is {_show([g.layout[k]])}, "
                                      f"not {_show([(r.n_regions, r.capacity)])}")

    def group_created(self, t: TenantRecord, gid: int) -> None:
        self.by_id[t.gang].groups[t.rank].append(gid)

    # ---- collective grants and releases ----------------------------------------------
    def part(self, t: TenantRecord, sender: Sender, r: Collective) -> Outcome:
        """One rank's part: checked now (its own group and units), answered when every
        rank's is in (or at its deadline)."""
        g = self.gang_of(t)
        grp = t.groups.get(r.group)
        if grp is None:
            raise Fail(p.NOT_FOUND, f"no group {r.group} in this session")
        k = g.index_of(t, r.group)
        ledger = self.devices[t.device].ledger
        op = "grant" if isinstance(r, p.Grant) else "release"
        if op == "grant":
            ledger.grantable(grp, r.units)
        else:
            ledger.releasable(grp, r.units)
        key: PartKey = (op, k, tuple(r.units))
        mine = set(r.units)
        pending = list(g.parts.items()) + [(w.key, w.parts) for w in self.waiting
                                           if w.gang is g]
        for (o, kk, units), waiting in pending:
            if kk == k and t.rank in waiting and mine & set(units):
                raise Fail(p.BAD_REQUEST, f"a unit of group {grp.id} is already in a waiting "
                                          f"{o} of this rank")
        parts = g.parts.setdefault(key, {})
        parts[t.rank] = Part(t, sender.envelope, r, grp, time.monotonic() + self.timeout_s)
        if len(parts) == g.size:
            del g.parts[key]
            self._ready.extend(self._grant(g, key, parts) if op == "grant"
                               else self._release(parts))
        return Outcome(None, tenant=t, deferred=True)

    def _grant(self, g: Gang, key: PartKey, parts: dict[int, Part]) -> list[Outcome]:
        """Every rank's part is in: commit now when it fits on every device, else wait
        for reclaim (when every short rank may), else every part the same error."""
        failed = self._admit(g, parts)
        if failed:
            return failed
        speculative = any(x.req.speculative for x in parts.values()
                          if isinstance(x.req, p.Grant))
        short = []
        for rank, part in sorted(parts.items()):  # room on every device, before any take
            dev, t, n = self.devices[part.tenant.device], part.tenant, _pages(part)
            if not speculative:
                dev.reclaimer.make_room(n)  # cached weight sets nobody holds go first
            if not dev.grants.fits(t, n, speculative):
                short.append(rank)
        if not short:
            return self._commit(g, parts)
        now = time.monotonic()
        why = self._refusal(g, parts, short, speculative, now)
        if why:
            return self._fail(parts, p.NO_MEMORY, why)
        waiters = {rank: self.devices[x.tenant.device].reclaimer.wait(
            x.tenant, x.envelope, x.req, _pages(x), now, collective=True)
            for rank, x in sorted(parts.items())}
        self.waiting.append(Waiting(g, key, parts, waiters, now + self.timeout_s))
        log.info("gang %d: a grant of %s pages waits for reclaim on device(s) %s", g.id,
                 _pages(parts[short[0]]), [parts[r].tenant.device for r in short])
        return []

    def _admit(self, g: Gang, parts: dict[int, Part]) -> list[Outcome]:
        """Every rank's admission (its cap, recovery); the failures ([]: all admitted)."""
        for rank, part in sorted(parts.items()):
            try:
                self.devices[part.tenant.device].grants.admit(part.tenant, _pages(part))
            except Fail as e:
                return self._fail(parts, e.code, f"gang {g.id} rank {rank}: {e}")
        return []

    def _refusal(self, g: Gang, parts: dict[int, Part], short: list[int],
                 speculative: bool, now: float) -> str:
        """Why the grant may not wait for reclaim ("": it may): as for a single grant,
        a speculative one never does, nor a gang asked to give back, nor one whose rank
        on a short device would pass its fair share (and no sleep covers it)."""
        for rank in short:
            t, n = parts[rank].tenant, _pages(parts[rank])
            rc = self.devices[t.device].reclaimer
            asked = any(x.tenant.ask is not None for x in parts.values())
            why = ("speculative grants use free memory only" if speculative else
                   f"{t.name} is being asked to give memory back" if asked else
                   "" if rc.may_grow(t, n) or rc.sleep_would_cover(t, n, now) else
                   f"{t.name} is at its fair share there")
            if why:
                return (f"gang {g.id}: {n} pages asked on device {t.device} (rank {rank}), "
                        f"{rc.pool.available - rc.waiting_pages} free there; {why}")
        return ""

    def serve(self) -> None:
        """Waiting grants whose every rank's device covers its pages now are committed
        (on every device at once); their answers join :meth:`take_ready`. Any device's
        tick calls this after its reclaim step."""
        for w in list(self.waiting):
            if all(self.devices[x.tenant.device].reclaimer.covers(x)
                   for x in w.waiters.values()):
                self._settle(w)
                self._ready.extend(self._admit(w.gang, w.parts)  # (its limit may have
                                   or self._commit(w.gang, w.parts))  # changed meanwhile)

    def _settle(self, w: Waiting) -> None:
        """``w`` is answered now: its waiters leave every device's queue."""
        self.waiting.remove(w)
        for x in w.waiters.values():
            self.devices[x.tenant.device].reclaimer.withdraw(x)

    def _commit(self, g: Gang, parts: dict[int, Part]) -> list[Outcome]:
        """Reserve on every device, then commit; or nothing (every part the error)."""
        order = sorted(parts.items())
        reserved: list[tuple[Part, list[int]]] = []
        for rank, part in order:  # reserve
            dev, t = self.devices[part.tenant.device], part.tenant
            try:
                reserved.append((part, dev.ledger.take(t, _pages(part))))
            except PoolExhausted as e:
                for done, pfns in reserved:  # nothing was exported: back, as they were
                    self.devices[done.tenant.device].ledger.untake(done.tenant, pfns)
                return self._fail(parts, p.NO_MEMORY, f"gang {g.id} rank {rank} (device "
                                                      f"{t.device}): {e}")
        out: list[Outcome] = []
        for part, pfns in reserved:  # commit
            t, r = part.tenant, part.req
            assert isinstance(r, p.Grant)
            reply = self.devices[t.device].ledger.commit(t, part.group, r, pfns)
            out.append(Outcome(reply, pfns_to_send=pfns, tenant=t, envelope=part.envelope))
        return out

    def _release(self, parts: dict[int, Part]) -> list[Outcome]:
        out: list[Outcome] = []
        for _, part in sorted(parts.items()):
            t, r = part.tenant, part.req
            self.devices[t.device].ledger.release(t, part.group, r.units, r.in_use, r.reserve)
            out.append(Outcome(p.Done(id=r.id), tenant=t, envelope=part.envelope))
        return out

    @staticmethod
    def _fail(parts: dict[int, Part], code: str, message: str) -> list[Outcome]:
        return [Outcome(p.error(x.req.id, code, message), tenant=x.tenant, envelope=x.envelope)
                for _, x in sorted(parts.items())]

    def next_deadline(self) -> float | None:
        return min([x.deadline for g in self.by_id.values() for parts in g.parts.values()
                    for x in parts.values()] + [w.deadline for w in self.waiting],
                   default=None)

    def expire(self, now: float) -> None:
        """Parts whose peers did not all come by their deadline are answered: the grant
        (or release) does not happen; nothing was reserved for it. So are grants that
        waited for reclaim past their deadline (nothing was taken for them)."""
        for w in [w for w in self.waiting if w.deadline <= now]:
            short = [(r, x.tenant.device) for r, x in sorted(w.waiters.items())
                     if not self.devices[x.tenant.device].reclaimer.covers(x)]
            self._settle(w)
            where = ", ".join(f"device {d} (rank {r})" for r, d in short) or "every device"
            self._ready.extend(self._fail(w.parts, p.NO_MEMORY, (
                f"gang {w.gang.id}: {_pages(next(iter(w.parts.values())))} pages not "
                f"freed on {where} within {self.timeout_s:g} s (reclaim deadline)")))
        for g in self.by_id.values():
            for key, parts in list(g.parts.items()):
                if min(x.deadline for x in parts.values()) > now:
                    continue
                del g.parts[key]
                absent = sorted(set(range(g.size)) - set(parts))
                self._ready.extend(self._fail(parts, p.NO_MEMORY, (
                    f"gang {g.id}: rank(s) {', '.join(map(str, absent))} did not send their "
                    f"part of this {key[0]} within {self.timeout_s:g} s")))

    # ---- the end ---------------------------------------------------------------------
    def dropped(self, t: TenantRecord, why: str) -> None:
        """``t``'s session ended (its own memory returns with it): its gang ends, every
        other rank's pages go back on its device, each is told."""
        g = self.by_id.get(t.gang) if t.gang else None
        if g is None:
            return
        g.ranks.pop(t.rank, None)
        for key, parts in list(g.parts.items()):  # waiting parts: answered (t's too)
            del g.parts[key]
            self._ready.extend(self._fail(parts, p.NO_MEMORY, (
                f"gang {g.id} ended: rank {t.rank} {why}")))
        for w in [w for w in self.waiting if w.gang is g]:  # so are its waiting grants
            self._settle(w)
            self._ready.extend(self._fail(w.parts, p.NO_MEMORY, (
                f"gang {g.id} ended: rank {t.rank} {why}")))
        if not g.ended:
            g.ended = f"rank {t.rank} (pid {t.pid}) {why}"
            log.warning("gang %d ended: %s", g.id, g.ended)
            for x in g.ranks.values():
                self._empty(x)
                self.outbox.send(x, p.GangEnded(gang_id=g.id, reason=g.ended))
        if not g.ranks:
            del self.by_id[g.id]
            self.by_token.pop(g.token, None)

    def _empty(self, x: TenantRecord) -> None:
        """Every page of ``x``'s groups goes back on its device (the groups stay)."""
        ledger = self.devices[x.device].ledger
        for grp in x.groups.values():
            ledger.empty(x, grp)

    # ---- reclaim: the gang gives back as one -----------------------------------------
    def mirror_asks(self, now: float) -> None:
        """An ask a device's reclaimer sent to one rank goes to every rank without one
        (same pages, mode and urgency): a collective release then counts against every
        rank's ask. Each ask is mirrored once (``Gang.mirrored``: the asks sent or
        mirrored already), never an ask that is itself a mirror."""
        for g in self.by_id.values():
            if g.ended:
                continue
            live = {(x.id, x.ask.seq) for x in g.ranks.values() if x.ask is not None}
            g.mirrored &= live  # (answered asks are forgotten)
            fresh = [x for x in g.ranks.values()
                     if x.ask is not None and (x.id, x.ask.seq) not in g.mirrored]
            for x in fresh:
                a = x.ask
                assert a is not None
                g.mirrored.add((x.id, a.seq))
                for y in g.ranks.values():
                    if y.ask is None:
                        self.devices[y.device].reclaimer.ask(y, a.pages, a.mode, a.urgent,
                                                             a.reason, now)
                        assert y.ask is not None
                        g.mirrored.add((y.id, y.ask.seq))

    # ---- integrity -----------------------------------------------------------------
    def check(self) -> list[str]:
        problems: list[str] = []
        for w in self.waiting:  # a waiting grant: a live gang, queued on every device
            queued = [r for r, x in w.waiters.items()
                      if x in self.devices[x.tenant.device].reclaimer.waiters]
            if w.gang.ended or sorted(queued) != list(range(w.gang.size)):
                problems.append(f"gang {w.gang.id}: a waiting grant is queued for ranks "
                                f"{sorted(queued)} only{' (the gang ended)' * bool(w.gang.ended)}")
        for g in self.by_id.values():
            for rank, x in g.ranks.items():
                if x.gang != g.id or x.rank != rank:
                    problems.append(f"gang {g.id}: rank {rank} is tenant {x.id}, which says "
                                    f"gang {x.gang} rank {x.rank}")
            if g.ended:
                held = [x.id for x in g.ranks.values() if x.granted]
                if held:
                    problems.append(f"gang {g.id} ended but tenants {held} still hold pages")
                continue
            for k in range(len(g.layout)):
                tables: dict[int, set[int]] = {}
                for rank, x in g.ranks.items():
                    gids = g.groups.get(rank, [])
                    grp = x.groups.get(gids[k]) if k < len(gids) else None
                    tables[rank] = set(grp.units) if grp is not None else set()
                if any(tables.values()) and (len(tables) != g.size or len(
                        {frozenset(u) for u in tables.values()}) != 1):
                    problems.append(f"gang {g.id} group {k} is half-granted: units by rank "
                                    f"{ {r: len(u) for r, u in sorted(tables.items())} }")
        return problems


def _pages(part: Part) -> int:
    """The pages ``part`` moves on its rank's device."""
    return len(part.req.units) * part.group.n_regions


def _show(layout: list[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{n} regions x {c} bytes" for n, c in layout) + "]"
