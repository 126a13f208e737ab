"""What the daemon decided and how long it took: counters, histograms and the event log.

:class:`Observer` implements the observation points of :mod:`kvpool.daemon.hooks`: the
arbiter calls it with every request handled, every tick and every session dropped, the
reclaimer with every ask sent and every page an asked tenant gives back, so that every
outcome is counted and recorded as it leaves them (:func:`attach` sets it up). Counters and
histograms are plain integers and lists updated by the event loop's thread only (no
locks on the grant path). Readers on other threads (the Prometheus exporter) never
look at the daemon's state: they ask the loop for a :class:`Snapshot` through a wake
pipe (:meth:`Observer.snapshot_from_loop`) and get one built between two requests, the
same ``ps`` view the control socket answers.

A *reclaim round* opens when a grant or lease has to wait and closes when no request
waits any more; it collects every ask sent and every page an asked tenant gave back
meanwhile (by tenant), the bytes the waiters were granted and the round's duration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from typing import Any, Callable, Sequence

from kvpool import protocol as p
from kvpool.daemon import metrics
from kvpool.daemon.arbiter import Arbiter
from kvpool.daemon.config import Config
from kvpool.daemon.counters import Counters
from kvpool.daemon.events import EventLog, Moves
from kvpool.daemon.fdwatch import FdWatch
from kvpool.daemon.measures import BYE_REASONS, HISTOGRAMS, Hist, Round, Snapshot
from kvpool.daemon.outcome import Outcome, Sender
from kvpool.daemon.pool import Pool
from kvpool.daemon.reclaim import Reclaimer
from kvpool.daemon.startup import StartupError
from kvpool.daemon.tenants import TenantRecord, Tenants
from kvpool.daemon.views import Views

log = logging.getLogger("kvpool.daemon.observe")


def _op(req: p.Request) -> str:
    return str(req.__struct_config__.tag)


Send = Callable[[list[bytes], p.Reply], None]  # a reply on the control socket


class Observer:
    """Records what the daemon decides (an :class:`~kvpool.daemon.hooks.ArbiterObserver`).

    It reads ``views`` (snapshots), ``reclaimer``'s waiters and ``pool``'s free pages (a
    reclaim round's bounds), the request ``counters`` and the live ``tenants``; its wake
    pipe is watched on ``fdwatch``, and parked ``Events`` followers are answered with
    ``send``. Events go to the daemon's ``events`` log through this device's ``moves``
    (the handlers record there too; the observer watches them for its reclaim round);
    a snapshot asked from another thread waits at most ``snapshot_timeout_s`` for the
    loop."""

    def __init__(self, views: Views, reclaimer: Reclaimer, pool: Pool, tenants: Tenants,
                 counters: Counters, fdwatch: FdWatch, send: Send, events: EventLog,
                 moves: Moves, snapshot_timeout_s: float):
        self.views = views
        self.reclaimer = reclaimer
        self.pool = pool
        self.tenants = tenants
        self.counters = counters
        self.fdwatch = fdwatch
        self.send = send
        self.snapshot_timeout_s = snapshot_timeout_s
        self.ps = pool.page_size
        self.counts: Counter[Any] = Counter()
        self.hists = {k: Hist(b) for k, b in HISTOGRAMS.items()}
        self._waiting: dict[tuple[int, int], tuple[float, int, str]] = {}  # (tenant, req id) -> (t0, pages, op)
        self._answered: Counter[int] = Counter()  # tenant id -> pages released since its ask
        self._given_now: Counter[int] = Counter()  # tenant id -> bytes of this release asked for
        self.round: Round | None = None
        self._errors_seen = 0  # error replies the arbiter produced (the rest: the server's)
        self._refused = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events = events
        events.waker(self._poke)  # the first device's observer flushes the followers
        self.moves = moves
        moves.attach(events, self._noted)
        self._want = False
        self._ready = threading.Event()
        self._snap_lock = threading.Lock()
        self.last: Snapshot | None = None
        self.snapshots_built = 0  # by the loop for the exporter (bounded: metrics.Exporter)
        self.exporter: metrics.Exporter | None = None  # when configured
        fdwatch.watch(self._wake_r, self._on_wake)

    # ---- the observation points (kvpool.daemon.hooks): never raise ----------------------
    def handled(self, req: p.Request, out: Outcome, dt: float, before: int,
                sender: TenantRecord | None) -> None:
        self._guard(self._handled, req, out, dt, before, sender)
        self._given_now.clear()  # (a request's own: a gang's part records no release)

    def ticked(self, outs: list[Outcome]) -> None:
        if outs or self.round is not None:
            self._guard(self._ticked, outs)

    def dropped(self, t: TenantRecord, why: str, held: int, arbitrated: bool,
                dt: float) -> None:
        self._guard(self._dropped, t, why, held, arbitrated, dt)

    def asked(self, t: TenantRecord, msg: p.Reclaim) -> None:
        self._guard(self._asked, t, msg)

    def gave_back(self, t: TenantRecord, pages: int, mode: str) -> None:
        self._guard(self._gave_back, t, pages, mode)

    @staticmethod
    def _guard(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # observing must never change what the daemon does
            log.exception("recording %s failed", fn.__name__)

    def _handled(self, req: p.Request, out: Outcome, dt: float, before: int,
                 sender: TenantRecord | None) -> None:
        t, reply = out.tenant or sender, out.reply
        if out.deferred:  # (a gang's part waits for its peers, not for reclaim: its
            # answer is observed with the tick's, kvpool.daemon.gangs)
            if isinstance(req, (p.Grant, p.Lease)) and t is not None and not t.gang:
                self._wait_began(t, req)
            return
        if isinstance(reply, p.Error):
            spec = bool(getattr(req, "speculative", False))
            self._error(t, "speculative" if spec else _op(req), reply, None)
        elif isinstance(reply, p.Claimed):  # a page handoff: pages moved, none granted
            self.moves.record("handoff", t, reply.nfds * self.ps, giver=reply.giver,
                               group=reply.group, units=len(reply.units))
        elif isinstance(reply, p.Granted):
            self.counts["grants"] += 1
            self.counts["grant_pages"] += reply.nfds
            self.hists["grant_service"].observe(dt)
            self.moves.record("grant", t, reply.nfds * self.ps, service_s=round(dt, 6),
                               group=reply.group, units=len(reply.units))
        elif isinstance(reply, p.Leased):
            self.counts["leases"] += 1
            self.moves.record("lease", t, reply.bytes)
        elif isinstance(req, (p.Release, p.DestroyGroup)) and t is not None:
            self.counts["releases"] += 1
            self.counts["release_pages"] += max(0, before - t.granted)
            if before > t.granted:  # (a gang's part moves nothing yet: gangs.py)
                self.moves.record("release", t, (before - t.granted) * self.ps, group=req.group)
        elif isinstance(req, p.Reclaimed) and t is not None:
            self.moves.record("answer", t, self._answered.pop(t.id, 0) * self.ps, seq=req.seq)
        elif isinstance(req, p.SetLimit):
            self.counts["limit_changes"] += 1
            change = {k: getattr(req, k) for k in ("min", "max", "shares")
                      if getattr(req, k) is not None}
            self.moves.record("limit", None, 0, tenants=[req.tenant], **change)
        self._close_round()

    def _error(self, t: TenantRecord | None, op: str, reply: p.Error,
               waited: float | None) -> None:
        self._errors_seen += 1
        self.counts["answers", reply.code] += 1
        if reply.code in (p.BAD_REQUEST, p.UNAUTHORIZED):
            self._refused += 1
        if op in ("grant", "lease") and reply.code in (p.NO_MEMORY, p.OVER_LIMIT):
            detail: dict[str, Any] = {"code": reply.code, "request": op,
                                      "message": reply.message[:200]}
            if waited is not None:
                detail["waited_s"] = round(waited, 6)
            self.moves.record("deny", t, 0, **detail)

    def _wait_began(self, t: TenantRecord, req: p.Grant | p.Lease) -> None:
        w = self.reclaimer.waiters[-1] if self.reclaimer.waiters else None
        pages = w.pages if w is not None and w.req is req else 0
        now = time.monotonic()
        self._waiting[(t.id, req.id)] = (now, pages, _op(req))
        self.counts["waits"] += 1
        if self.round is None:
            self.round = Round(start=now, free_at_start=self.pool.available * self.ps)
        self.round.waiters += 1
        self.moves.record("wait", t, pages * self.ps, request=_op(req))

    def _ticked(self, outs: list[Outcome]) -> None:
        now = time.monotonic()
        for o in outs:
            t, reply = o.tenant, o.reply
            assert t is not None and reply is not None  # tick's outcomes have both
            if isinstance(reply, p.Claimed):  # a handoff whose giver let go (no wait)
                self.moves.record("handoff", t, reply.nfds * self.ps, giver=reply.giver,
                                   group=reply.group, units=len(reply.units))
                continue
            t0, pages, op = self._waiting.pop((t.id, reply.id), (now, 0, ""))
            waited = now - t0
            rnd = self.round
            if isinstance(reply, p.Error):
                if rnd is not None:
                    rnd.failed += 1
                self._error(t, op, reply, waited)
                continue
            self.hists["grant_wait"].observe(waited)
            if rnd is not None:
                rnd.served += 1
                rnd.granted += pages * self.ps
            if isinstance(reply, p.Granted):
                self.counts["grants"] += 1
                self.counts["grant_pages"] += reply.nfds
                self.moves.record("grant", t, reply.nfds * self.ps, waited_s=round(waited, 6),
                                   group=reply.group, units=len(reply.units))
            elif isinstance(reply, p.Leased):
                self.counts["leases"] += 1
                self.moves.record("lease", t, reply.bytes, waited_s=round(waited, 6),
                                   grew=pages * self.ps)
        self._close_round()

    def _asked(self, t: TenantRecord, msg: p.Reclaim) -> None:
        self.counts["asks", msg.mode] += 1
        self._answered[t.id] = 0
        if self.round is not None:
            self.round.asked[t.name] += msg.bytes
        self.moves.record("ask", t, msg.bytes, mode=msg.mode, urgent=msg.urgent,
                           reason=msg.reason, seq=msg.seq)

    def _gave_back(self, t: TenantRecord, pages: int, mode: str) -> None:
        nbytes = pages * self.ps
        self._answered[t.id] += pages
        self._given_now[t.id] += nbytes  # (its release event must not count it again)
        self.counts["reclaimed_bytes", t.name, mode] += nbytes
        if self.round is not None:
            self.round.answered[t.name] += nbytes
            self.round.by_mode[mode] += nbytes

    def _noted(self, ev: p.EventInfo) -> None:
        """A move recorded on this device (by a handler or here): a reclaim round
        counts who was put to sleep for it, what that tenant gave back meanwhile and the
        cached weight sets dropped."""
        counted = self._given_now.pop(ev.tenant_id, 0) if ev.kind == "release" else 0
        rnd = self.round
        if rnd is None:
            return
        if ev.kind == "ask" and ev.detail.get("mode") == "sleep" \
                and ev.detail.get("reason") == "pressure":
            rnd.slept[ev.tenant] += ev.bytes
            rnd.sleepers.add(ev.tenant_id)
        elif ev.tenant_id in rnd.sleepers and (ev.kind == "release" or (
                ev.kind == "weights" and ev.detail.get("op") == "detach")):
            rnd.answered[ev.tenant] += ev.bytes - counted  # (what gave_back did not count)
        elif ev.kind == "weights" and ev.detail.get("op") == "evict":
            rnd.evicted += ev.bytes

    def _dropped(self, t: TenantRecord, why: str, held: int, arbitrated: bool,
                 dt: float) -> None:
        self.events.forget(t.id)
        self._answered.pop(t.id, None)
        self._given_now.pop(t.id, None)
        for key in [k for k in self._waiting if k[0] == t.id]:
            del self._waiting[key]
        if arbitrated:
            bye = why in BYE_REASONS
            self.counts["drops", "bye" if bye else "death"] += 1
            self.hists["tenant_drop"].observe(dt)
            self.moves.record("bye" if bye else "death", t, held * self.ps, reason=why,
                               seconds=round(dt, 6))
        self._close_round()

    def _close_round(self) -> None:
        rnd = self.round
        if rnd is None or self.reclaimer.waiters:
            return
        self.round = None
        dt = time.monotonic() - rnd.start
        given = sum(rnd.answered.values())
        from_pool = max(0, rnd.granted - given)
        self.counts["rounds"] += 1
        for stage, nbytes in (("warm_pool", from_pool), ("reserves", rnd.by_mode["reserve"]),
                              ("shrink", rnd.by_mode["shrink"])):
            if nbytes:
                self.counts["rounds_by_stage", stage] += 1
        self.hists["reclaim_round"].observe(dt)
        self.moves.record(
            "reclaim", None, rnd.granted, duration_s=round(dt, 6), asked=dict(rnd.asked),
            answered=dict(rnd.answered), slept=dict(rnd.slept), evicted=rnd.evicted,
            free_at_start=rnd.free_at_start,
            from_pool=from_pool, waiters=rnd.waiters, served=rnd.served, failed=rnd.failed,
            tenants=sorted(set(rnd.asked) | set(rnd.answered) | set(rnd.slept)))

    # ---- the Events request --------------------------------------------------------
    def events_request(self, t: TenantRecord, sender: Sender,
                       r: p.Events) -> p.Reply | Outcome:
        """The ``Events`` request's handler (the arbiter dispatches it here)."""
        reply = self.events.request(t.id, sender.envelope, r)
        if reply is None:
            return Outcome(None, tenant=t, deferred=True)
        return reply

    # ---- the loop side of the wake pipe --------------------------------------------
    def _poke(self) -> None:
        if self._wake_w < 0:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _on_wake(self, fd: int, ev: int = 0) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 4096)
        if self._want:
            self._want = False
            self.last = self.snapshot()
            self.snapshots_built += 1
            self._ready.set()
        live = self.tenants.by_id
        for tid in [tid for tid in self.events.followers if tid not in live]:
            self.events.forget(tid)
        self.events.flush(self.send)

    def snapshot(self) -> Snapshot:
        """The state now (loop thread only)."""
        n = self.counters
        t0 = time.perf_counter()
        refused = self._refused + max(0, n.errors - self._errors_seen)
        snap = Snapshot(
            taken=time.time(), pool=self.views.pool_info(), tenants=self.views.listed(),
            counters=dict(self.counts), hists={k: h.copy() for k, h in self.hists.items()},
            requests=n.requests, errors=n.errors, refused=refused,
            waiters=len(self.reclaimer.waiters), uptime_s=n.uptime_s,
            events=self.events.recorded[self.moves.device])
        snap.build_s = time.perf_counter() - t0
        return snap

    def snapshot_from_loop(self, timeout_s: float | None = None) -> Snapshot | None:
        """From any other thread: a snapshot built by the loop at its next turn (or the
        last one, when the loop does not get to it within ``timeout_s``)."""
        with self._snap_lock:
            self._ready.clear()
            self._want = True
            self._poke()
            self._ready.wait(self.snapshot_timeout_s if timeout_s is None else timeout_s)
            return self.last

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self.fdwatch.unwatch(self._wake_r)
        self._ready.set()
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def attach(arbiter: Arbiter, fdwatch: FdWatch, send: Send, cfg: Config,
           others: Sequence[Observer] = (), events: EventLog | None = None) -> Observer:
    """Observe ``arbiter`` (it reports to the observer and dispatches ``Events`` to it);
    its events (and its handlers' moves) go to ``events``, the daemon's one log (a new
    one of ``cfg.event_ring`` events when None); the wake pipe on ``fdwatch``, followers
    answered with ``send``; serve ``/metrics`` when ``cfg`` names an address (a refused
    or unusable one is a ``StartupError``), with the other devices' observers
    ``others`` (their ``device`` label)."""
    if events is None:
        events = EventLog(size=cfg.event_ring)
    obs = Observer(arbiter.views, arbiter.reclaimer, arbiter.pool, arbiter.tenants,
                   arbiter.counters, fdwatch, send, events, arbiter.moves,
                   cfg.snapshot_timeout_s)
    arbiter.observe(obs)
    arbiter.add_handler(p.Events, obs.events_request)
    address = cfg.metrics_address
    if address:
        try:
            host, port = metrics.parse_address(address, bool(cfg.metrics_allow_remote))
            obs.exporter = metrics.Exporter([obs, *others], host, port)
        except (ValueError, OSError) as e:
            obs.close()
            raise StartupError(f"cannot serve metrics: {e}") from None
        log.info("metrics on http://%s:%d/metrics", host, obs.exporter.port)
    return obs
