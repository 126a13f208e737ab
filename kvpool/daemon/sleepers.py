"""Who sleeps: tenants' sleep states, the operator's sleep/wake, and the one idle tenant
the daemon puts to sleep when a waiting grant cannot be met otherwise
(docs/ARCHITECTURE.md, "Sleep and wake").

A tenant says what it is doing with ``TenantState``: ``busy`` (serving), ``idle``
(nothing to do; the daemon notes since when) or ``asleep`` (it released its KV pages and
its weight-set holds). A tenant that never said is ``awake`` (treated like ``busy``:
never put to sleep by the daemon). The daemon never changes a state itself: it asks
(``SleepAsk``, unsolicited) and the tenant answers by reporting its new state.

Two ways to ask:

* the operator (``kvpool sleep NAME`` / ``kvpool wake NAME``: ``SleepTenant``) asks every
  tenant of that name; allowed to the tenants' own uid and to admin identities
  (:func:`kvpool.daemon.auth.may_act_on`), refused ``UNAUTHORIZED`` otherwise;
* the reclaimer (:meth:`SleepBook.put_one_to_sleep`, the
  :class:`kvpool.daemon.reclaim.SleepSource` seam) when the waiting grants still miss
  pages after it asked every tenant it could for KV: it asks ONE tenant that opted in
  (``sleepable``: the config's ``[tenants.NAME] sleepable``, else ``Register.sleepable``),
  says ``idle``, is not itself waiting, has no pressure ask pending or recently refused,
  and whose sleep would free something: its KV, and the weight sets it is the last
  holder of (:meth:`SleepBook.frees`; a set another tenant still holds stays, so a
  replica sharing its model's set with a busy one is credited with its KV only). First
  the candidates whose sleep covers what the waiters miss (the longest idle, then the
  fewest shares), else the one that frees the most; when the best one is answering a
  reclaim ask it is waited for, not passed over for a worse one. One pressure ask is
  outstanding at a time: a tenant asleep frees its whole holding, usually more than the
  waiter misses, and putting a second to sleep before the first has released would put
  to sleep one too many. A tenant that refuses (reports ``idle`` or ``busy`` again) or
  does not answer within ``2 x reclaim_timeout_s`` is not asked again for that long;
  the waiting grant then ends ``NO_MEMORY`` at its own deadline, as without sleep.

What the sleeping tenant releases flows back the ordinary way (``Release``,
``WeightDetach``); a weight set nobody holds any more is cached and the first memory
the reclaimer evicts, so the waiting grant is served by the reclaimer's next step.
The state of a tenant whose session ends is forgotten with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AbstractSet, Callable, Final

from kvpool import protocol as p
from kvpool.daemon.auth import may_act_on
from kvpool.daemon.config import Config
from kvpool.daemon.events import Moves
from kvpool.daemon.outcome import Fail, Outbox, Sender
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord, Tenants

log = logging.getLogger("kvpool.daemon.sleepers")

NEVER_SAID: Final = "awake"  # the state of a tenant that never sent TenantState


@dataclass(eq=False)
class SleepState:
    """One tenant's sleep record (by tenant id in :class:`SleepBook`)."""

    sleepable: bool = False
    state: p.ShownState = NEVER_SAID  # what it said (p.SaidState), else NEVER_SAID
    idle_since: float = 0.0  # monotonic: when it last said ``idle`` after something else
    asked_at: float | None = None  # a pressure ask is pending since then
    not_before: float = 0.0  # refused or ignored a pressure ask: not asked before this
    changes: int = 0  # states it reported that differed from the one before
    holding: int = 0  # pages it held (KV, lease, weight sets) at its last report
    ask: str = ""  # the daemon's last ask not answered yet: "sleep:REASON", "wake:REASON"


class SleepBook:
    """The sleep states of ``tenants`` (sleepable as ``cfg`` says, else as each asked);
    asks leave through ``outbox``; a pressure ask left unanswered ``2 x timeout_s``
    (the reclaim deadline) is given up. ``sole_weights(t)``: pages of the weight sets
    ``t`` alone holds (``WeightSets.sole_pages``; what its sleep gives back of them).
    Asks, sleeps and wakes are recorded in ``moves``."""

    def __init__(self, cfg: Config, tenants: Tenants, outbox: Outbox, timeout_s: float,
                 sole_weights: Callable[[TenantRecord], int], moves: Moves | None = None):
        self.moves = moves if moves is not None else Moves()
        self.cfg = cfg
        self.tenants = tenants
        self.outbox = outbox
        self.sole_weights = sole_weights
        self.patience_s = 2 * timeout_s
        self.records: dict[int, SleepState] = {}
        self._seq = 0

    # ---- sessions ------------------------------------------------------------------
    def registered(self, t: TenantRecord, r: p.Register) -> None:
        """``t`` registered with ``r``: whether it may be put to sleep (config first)."""
        if t.kind in NO_MEMORY_KINDS:
            return
        policy = self.cfg.tenants.get(t.name)
        configured = policy.sleepable if policy is not None else None
        sleepable = configured if configured is not None else bool(r.sleepable)
        self.records[t.id] = SleepState(sleepable=sleepable)

    def dropped(self, t: TenantRecord) -> None:
        """``t``'s session ended: its record goes with it."""
        self.records.pop(t.id, None)

    def record(self, t: TenantRecord) -> SleepState:
        return self.records.get(t.id) or SleepState()

    # ---- requests --------------------------------------------------------------------
    def sleep_tenant(self, t: TenantRecord, sender: Sender, r: p.SleepTenant) -> p.Reply:
        """The operator's ``kvpool sleep|wake NAME``: ask every tenant of that name."""
        named = self.tenants.named(r.name)
        foreign = [x for x in named if not may_act_on(t, x)]
        if foreign:
            verb = "wake" if r.wake else "put to sleep"
            raise Fail(p.UNAUTHORIZED, f"tenant {r.name!r} runs as uid {foreign[0].uid}; uid "
                                       f"{t.uid} may not {verb} it (its own uid or an admin "
                                       f"may)")
        for x in named:
            self._send(x, r.wake, "operator")
        log.info("%s asked by tenant %d (uid %d) for %s: %d tenants",
                 "wake" if r.wake else "sleep", t.id, t.uid, r.name, len(named))
        return p.SleepAsked(id=r.id, tenants=len(named))

    def tenant_state(self, t: TenantRecord, sender: Sender, r: p.TenantState,
                     now: float) -> p.Reply:
        """The tenant says it is ``busy``, ``idle`` or ``asleep`` (O(1): a flood of them
        costs a dict lookup each)."""
        if t.kind in NO_MEMORY_KINDS:
            raise Fail(p.UNAUTHORIZED, f"a {t.kind} session holds no memory: it has no "
                                       f"sleep state")
        rec = self.records.setdefault(t.id, SleepState())
        if r.state != rec.state:
            rec.changes += 1
            if r.state == "idle":
                rec.idle_since = now
            log.debug("tenant %d (%s): %s -> %s", t.id, t.name, rec.state, r.state)
            self._record_change(t, rec, r)
            rec.state = r.state
        rec.holding = t.held + t.weight_pages
        if rec.asked_at is not None:  # its answer to a pressure ask
            rec.asked_at = None
            if r.state != "asleep":  # refused: do not ask it again at once
                rec.not_before = now + self.patience_s
        return p.Done(id=r.id)

    # ---- the reclaimer's seam ----------------------------------------------------------
    @property
    def pending(self) -> bool:
        return any(rec.asked_at is not None for rec in self.records.values())

    def put_one_to_sleep(self, spare: AbstractSet[int], need: int,
                         now: float) -> TenantRecord | None:
        """Waiting grants miss ``need`` pages no tenant was asked for: ask the best
        candidate (not one in ``spare``, the waiters' tenant ids) to sleep. Returns the
        tenant asked, None when none was (one is pending already, the best one is
        answering a reclaim ask, or nobody's sleep would free anything)."""
        for rec in self.records.values():  # a pending ask that was never answered
            if rec.asked_at is not None and now - rec.asked_at >= self.patience_s:
                rec.asked_at = None
                rec.not_before = now + self.patience_s
        victim = self._choose(spare, need, now)
        if victim is None or victim.ask is not None:  # (wait for its answer to the ask)
            return None
        self.records[victim.id].asked_at = now
        self._send(victim, False, "pressure")
        log.info("asked tenant %d (%s) to sleep: waiting grants miss %d pages, its sleep "
                 "frees %d (idle %.1f s)", victim.id, victim.name, need, self.frees(victim),
                 now - self.records[victim.id].idle_since)
        return victim

    def could_free(self, spare: AbstractSet[int], need: int, now: float) -> int:
        """What the sleep of the tenant :meth:`put_one_to_sleep` would choose for
        ``need`` pages frees (0: nobody)."""
        victim = self._choose(spare, need, now)
        return 0 if victim is None else self.frees(victim)

    def frees(self, t: TenantRecord) -> int:
        """Pages ``t``'s sleep gives back: all it holds (KV, lease), and the weight sets
        it is the last holder of (a set another tenant holds stays)."""
        return t.held + self.sole_weights(t)

    def _choose(self, spare: AbstractSet[int], need: int, now: float) -> TenantRecord | None:
        """Of the tenants that may be asked (none while a pressure ask is pending) and
        whose sleep frees something: those that free ``need`` first (the longest idle,
        then the fewest shares), else the one that frees the most."""
        if self.pending:
            return None
        freed = {t.id: self.frees(t) for t in self.tenants
                 if t.arbitrated and t.id not in spare and self._may_ask(t, now)}
        candidates = [t for t in self.tenants if freed.get(t.id, 0) > 0]
        if not candidates:
            return None

        def rank(t: TenantRecord) -> tuple[bool, int, float, float, int]:
            covers = freed[t.id] >= need
            return (not covers, 0 if covers else -freed[t.id],
                    self.records[t.id].idle_since, t.shares, t.id)

        return min(candidates, key=rank)

    def _may_ask(self, t: TenantRecord, now: float) -> bool:
        """Whether ``t`` is a candidate (it may be answering a reclaim ask: then it is
        waited for, :meth:`put_one_to_sleep`)."""
        rec = self.records.get(t.id)
        return (rec is not None and rec.sleepable and rec.state == "idle"
                and rec.asked_at is None and rec.not_before <= now
                and t.waiting_pages == 0)

    def _send(self, t: TenantRecord, wake: bool, reason: str) -> None:
        self._seq += 1
        self.outbox.send(t, p.SleepAsk(wake=wake, reason=reason, seq=self._seq))
        if t.id in self.records:
            self.records[t.id].ask = f"{'wake' if wake else 'sleep'}:{reason}"
        self.moves.pages("ask", t, t.held + t.weight_pages, mode="wake" if wake else "sleep",
                         reason=reason)

    def _record_change(self, t: TenantRecord, rec: SleepState, r: p.TenantState) -> None:
        """A sleep (to ``asleep``: what it freed since its last report) or a wake (from
        ``asleep``: what it took back) is an event; its reason is the daemon's ask it
        answers, else the tenant's own word, else ``tenant``."""
        asked, rec.ask = rec.ask, ""
        if "asleep" not in (r.state, rec.state):
            return
        kind = "sleep" if r.state == "asleep" else "wake"
        verb, _, reason = asked.partition(":")
        reason = reason if verb == kind else (r.reason or "tenant")
        now = t.held + t.weight_pages
        if kind == "sleep":
            self.moves.pages(kind, t, max(0, rec.holding - now), reason=reason)
        else:
            self.moves.pages(kind, t, max(0, now - rec.holding), reason=reason)
