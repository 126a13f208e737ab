"""What the daemon decided and how long it took: counters, histograms and the event log.

:func:`attach` wraps a few of the arbiter's entry points (``handle``, ``tick``, ``drop``,
``unsolicited`` and the reclaimer's ``released``) so that every outcome is counted and
recorded as it leaves them; the request logic itself is untouched. Counters and
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

import bisect
import contextlib
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.daemon.events import EventLog

log = logging.getLogger("kvpool.daemon.observe")

# bucket bounds (seconds)
FAST = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
SLOW = (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
HISTOGRAMS = {
    "grant_service": FAST,  # a grant served at once: time in the arbiter
    "grant_wait": SLOW,  # a grant or lease that waited for reclaim: request to answer
    "reclaim_round": SLOW,  # a reclaim round: first waiter to no waiter
    "tenant_drop": FAST,  # a departed tenant's memory back in the pool
}
BYE_REASONS = ("said bye", "daemon shutting down")


class Hist:
    """A cumulative-bucket histogram (Prometheus ``le`` semantics), loop thread only."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v

    def copy(self) -> "Hist":
        h = Hist(self.bounds)
        h.counts, h.sum = list(self.counts), self.sum
        return h


@dataclass
class Round:
    start: float
    free_at_start: int  # bytes free (warm, dirty, unallocated) when the round opened
    asked: Counter = field(default_factory=Counter)  # tenant name -> bytes asked
    answered: Counter = field(default_factory=Counter)  # tenant name -> bytes given back
    by_mode: Counter = field(default_factory=Counter)  # reserve | shrink -> bytes given back
    granted: int = 0  # bytes granted to the round's waiters
    waiters: int = 0
    served: int = 0
    failed: int = 0


@dataclass
class Snapshot:
    """The daemon's state at one moment between two requests (built on the loop)."""

    taken: float
    pool: p.PoolInfo
    tenants: list[p.TenantInfo]
    counters: dict
    hists: dict[str, Hist]
    requests: int
    errors: int
    refused: int
    waiters: int
    uptime_s: float
    events: int
    build_s: float = 0.0  # time the loop spent building it


class Observer:
    def __init__(self, server):
        self.server = server
        self.a = server.arbiter
        self.ps = self.a.page_size
        self.counts: Counter = Counter()
        self.hists = {k: Hist(b) for k, b in HISTOGRAMS.items()}
        self._waiting: dict[tuple[int, int], tuple[float, int, str]] = {}  # (tenant, req id) -> (t0, pages, op)
        self._answered: Counter = Counter()  # tenant id -> pages released since its ask
        self.round: Round | None = None
        self._errors_seen = 0  # error replies the arbiter produced (the rest: the server's)
        self._refused = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events = EventLog(wake=self._poke)
        self._want = False
        self._ready = threading.Event()
        self._snap_lock = threading.Lock()
        self.last: Snapshot | None = None
        self.exporter = None  # metrics.Exporter when configured
        self._wrap()
        server._watch(self._wake_r, self._on_wake)

    # ---- hooks ------------------------------------------------------------------------
    def _wrap(self) -> None:
        a, r = self.a, self.a.reclaimer
        handle, tick, drop = a.handle, a.tick, a.drop
        unsolicited, released = a.unsolicited, r.released

        def on_handle(identity, req, envelope=None):
            t = a.tenants.by_token.get(req.token) if req.token else None
            before = t.granted if t is not None else 0
            t0 = time.perf_counter()
            out = handle(identity, req, envelope)
            self._guard(self._handled, req, out, time.perf_counter() - t0, before, t)
            return out

        def on_tick(now=None):
            outs = tick(now)
            if outs or self.round is not None:
                self._guard(self._ticked, outs)
            return outs

        def on_drop(t, why):
            held, arbitrated, t0 = t.held, t.arbitrated, time.perf_counter()
            drop(t, why)
            self._guard(self._dropped, t, why, held, arbitrated, time.perf_counter() - t0)

        def on_unsolicited(t, msg):
            unsolicited(t, msg)
            if isinstance(msg, p.Reclaim):
                self._guard(self._asked, t, msg)

        def on_released(t, pages):
            ask = t.ask
            released(t, pages)
            if ask is not None:
                self._guard(self._gave_back, t, pages, ask.mode)

        a.handle, a.tick, a.drop, a.unsolicited, r.released = (
            on_handle, on_tick, on_drop, on_unsolicited, on_released)
        a._handlers[p.Events] = self._events_request

    @staticmethod
    def _guard(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # observing must never change what the daemon does
            log.exception("recording %s failed", fn.__name__)

    def _handled(self, req, out, dt: float, before: int, sender) -> None:
        t, reply = out.tenant or sender, out.reply
        if out.deferred:
            if isinstance(req, (p.Grant, p.Lease)):
                self._wait_began(t, req)
            return
        if isinstance(reply, p.Error):
            spec = bool(getattr(req, "speculative", False))
            self._error(t, "speculative" if spec else req.__struct_config__.tag, reply, None)
        elif isinstance(reply, p.Granted):
            self.counts["grants"] += 1
            self.counts["grant_pages"] += reply.nfds
            self.hists["grant_service"].observe(dt)
            self.events.record("grant", t, reply.nfds * self.ps, service_s=round(dt, 6),
                               group=reply.group, units=len(reply.units))
        elif isinstance(reply, p.Leased):
            self.counts["leases"] += 1
            self.events.record("lease", t, reply.bytes)
        elif isinstance(req, (p.Release, p.DestroyGroup)) and t is not None:
            self.counts["releases"] += 1
            self.counts["release_pages"] += max(0, before - t.granted)
        elif isinstance(req, p.Reclaimed) and t is not None:
            self.events.record("answer", t, self._answered.pop(t.id, 0) * self.ps, seq=req.seq)
        elif isinstance(req, p.SetLimit):
            self.counts["limit_changes"] += 1
            change = {k: getattr(req, k) for k in ("min", "max", "weight")
                      if getattr(req, k) is not None}
            self.events.record("limit", None, 0, tenants=[req.tenant], **change)
        self._close_round()

    def _error(self, t, op: str, reply: p.Error, waited: float | None) -> None:
        self._errors_seen += 1
        self.counts["answers", reply.code] += 1
        if reply.code in (p.BAD_REQUEST, p.UNAUTHORIZED):
            self._refused += 1
        if op in ("grant", "lease") and reply.code in (p.NO_MEMORY, p.OVER_LIMIT):
            detail = {"code": reply.code, "request": op, "message": reply.message[:200]}
            if waited is not None:
                detail["waited_s"] = round(waited, 6)
            self.events.record("deny", t, 0, **detail)

    def _wait_began(self, t, req) -> None:
        w = self.a.reclaimer.waiters[-1] if self.a.reclaimer.waiters else None
        pages = w.pages if w is not None and w.req is req else 0
        now = time.monotonic()
        self._waiting[(t.id, req.id)] = (now, pages, req.__struct_config__.tag)
        self.counts["waits"] += 1
        if self.round is None:
            self.round = Round(start=now, free_at_start=self.a.pool.available * self.ps)
        self.round.waiters += 1
        self.events.record("wait", t, pages * self.ps, request=req.__struct_config__.tag)

    def _ticked(self, outs) -> None:
        now = time.monotonic()
        for o in outs:
            t, reply = o.tenant, o.reply
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
                self.events.record("grant", t, reply.nfds * self.ps, waited_s=round(waited, 6),
                                   group=reply.group, units=len(reply.units))
            elif isinstance(reply, p.Leased):
                self.counts["leases"] += 1
                self.events.record("lease", t, reply.bytes, waited_s=round(waited, 6),
                                   grew=pages * self.ps)
        self._close_round()

    def _asked(self, t, msg: p.Reclaim) -> None:
        self.counts["asks", msg.mode] += 1
        self._answered[t.id] = 0
        if self.round is not None:
            self.round.asked[t.name] += msg.bytes
        self.events.record("ask", t, msg.bytes, mode=msg.mode, urgent=msg.urgent,
                           reason=msg.reason, seq=msg.seq)

    def _gave_back(self, t, pages: int, mode: str) -> None:
        nbytes = pages * self.ps
        self._answered[t.id] += pages
        self.counts["reclaimed_bytes", t.name, mode] += nbytes
        if self.round is not None:
            self.round.answered[t.name] += nbytes
            self.round.by_mode[mode] += nbytes

    def _dropped(self, t, why: str, held: int, arbitrated: bool, dt: float) -> None:
        self.events.forget(t.id)
        self._answered.pop(t.id, None)
        for key in [k for k in self._waiting if k[0] == t.id]:
            del self._waiting[key]
        if arbitrated:
            bye = why in BYE_REASONS
            self.counts["drops", "bye" if bye else "death"] += 1
            self.hists["tenant_drop"].observe(dt)
            self.events.record("bye" if bye else "death", t, held * self.ps, reason=why,
                               seconds=round(dt, 6))
        self._close_round()

    def _close_round(self) -> None:
        rnd = self.round
        if rnd is None or self.a.reclaimer.waiters:
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
        self.events.record(
            "reclaim", None, rnd.granted, duration_s=round(dt, 6), asked=dict(rnd.asked),
            answered=dict(rnd.answered), free_at_start=rnd.free_at_start,
            from_pool=from_pool, waiters=rnd.waiters, served=rnd.served, failed=rnd.failed,
            tenants=sorted(set(rnd.asked) | set(rnd.answered)))

    # ---- the Events request --------------------------------------------------------
    def _events_request(self, t, identity, r: p.Events):
        from kvpool.daemon.arbiter import Outcome

        reply = self.events.request(t.id, self.a._envelope, r)
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
            self._ready.set()
        live = self.a.tenants.by_id
        for tid in [tid for tid in self.events.followers if tid not in live]:
            self.events.forget(tid)
        self.events.flush(self.server._reply)

    def snapshot(self) -> Snapshot:
        """The state now (loop thread only)."""
        a = self.a
        t0 = time.perf_counter()
        refused = self._refused + max(0, a.errors - self._errors_seen)
        snap = Snapshot(
            taken=time.time(), pool=a.pool_info(), tenants=a.listed(),
            counters=dict(self.counts), hists={k: h.copy() for k, h in self.hists.items()},
            requests=a.requests, errors=a.errors, refused=refused,
            waiters=len(a.reclaimer.waiters), uptime_s=time.monotonic() - a.started,
            events=self.events.seq)
        snap.build_s = time.perf_counter() - t0
        return snap

    def snapshot_from_loop(self, timeout_s: float = 2.0) -> Snapshot | None:
        """From any other thread: a snapshot built by the loop at its next turn (or the
        last one, when the loop does not get to it within ``timeout_s``)."""
        with self._snap_lock:
            self._ready.clear()
            self._want = True
            self._poke()
            self._ready.wait(timeout_s)
            return self.last

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self.server._unwatch(self._wake_r)
        self._ready.set()
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def attach(server) -> Observer:
    """Observe ``server``'s arbiter; serve ``/metrics`` when its config names an address
    (a refused or unusable address is a ``StartupError``)."""
    from kvpool.daemon import metrics
    from kvpool.daemon.server import StartupError

    obs = Observer(server)
    address = getattr(server.cfg, "metrics_address", None)
    if address:
        try:
            host, port = metrics.parse_address(address, bool(
                getattr(server.cfg, "metrics_allow_remote", False)))
            obs.exporter = metrics.Exporter(obs, host, port)
        except (ValueError, OSError) as e:
            obs.close()
            raise StartupError(f"cannot serve metrics: {e}") from None
        log.info("metrics on http://%s:%d/metrics", host, obs.exporter.port)
    return obs
