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

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from kvpool import protocol as p
from kvpool.daemon.events import EventLog
from kvpool.daemon.measures import BYE_REASONS, HISTOGRAMS, Hist, Round, Snapshot
from kvpool.daemon.outcome import Outcome
from kvpool.daemon.tenants import TenantRecord

if TYPE_CHECKING:
    from kvpool.daemon.metrics import Exporter
    from kvpool.daemon.server import Server

log = logging.getLogger("kvpool.daemon.observe")


def _op(req: p.Request) -> str:
    return str(req.__struct_config__.tag)


def _replace(obj: object, name: str, fn: Callable[..., Any]) -> None:
    """Put ``fn`` in place of ``obj.name`` on this instance (an observing wrapper; the
    class and its other instances are untouched)."""
    setattr(obj, name, fn)


class Observer:
    def __init__(self, server: Server):
        self.server = server
        self.arbiter = server.arbiter
        self.ps = self.arbiter.page_size
        self.counts: Counter[Any] = Counter()
        self.hists = {k: Hist(b) for k, b in HISTOGRAMS.items()}
        self._waiting: dict[tuple[int, int], tuple[float, int, str]] = {}  # (tenant, req id) -> (t0, pages, op)
        self._answered: Counter[int] = Counter()  # tenant id -> pages released since its ask
        self.round: Round | None = None
        self._errors_seen = 0  # error replies the arbiter produced (the rest: the server's)
        self._refused = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events = EventLog(size=server.cfg.event_ring, wake=self._poke)
        self._want = False
        self._ready = threading.Event()
        self._snap_lock = threading.Lock()
        self.last: Snapshot | None = None
        self.exporter: Exporter | None = None  # when configured
        self._wrap()
        server.watch(self._wake_r, self._on_wake)

    # ---- hooks ------------------------------------------------------------------------
    def _wrap(self) -> None:
        a, r = self.arbiter, self.arbiter.reclaimer
        handle, tick, drop = a.handle, a.tick, a.drop
        unsolicited, released = a.unsolicited, r.released

        def on_handle(identity: bytes, req: p.Request,
                      envelope: list[bytes] | None = None) -> Outcome:
            t = a.tenants.by_token.get(req.token) if req.token else None
            before = t.granted if t is not None else 0
            t0 = time.perf_counter()
            out = handle(identity, req, envelope)
            self._guard(self._handled, req, out, time.perf_counter() - t0, before, t)
            return out

        def on_tick(now: float | None = None) -> list[Outcome]:
            outs = tick(now)
            if outs or self.round is not None:
                self._guard(self._ticked, outs)
            return outs

        def on_drop(t: TenantRecord, why: str) -> None:
            held, arbitrated, t0 = t.held, t.arbitrated, time.perf_counter()
            drop(t, why)
            self._guard(self._dropped, t, why, held, arbitrated, time.perf_counter() - t0)

        def on_unsolicited(t: TenantRecord, msg: p.Reply) -> None:
            unsolicited(t, msg)
            if isinstance(msg, p.Reclaim):
                self._guard(self._asked, t, msg)

        def on_released(t: TenantRecord, pages: int) -> None:
            ask = t.ask
            released(t, pages)
            if ask is not None:
                self._guard(self._gave_back, t, pages, ask.mode)

        for obj, name, fn in ((a, "handle", on_handle), (a, "tick", on_tick),
                              (a, "drop", on_drop), (a, "unsolicited", on_unsolicited),
                              (r, "released", on_released)):
            _replace(obj, name, fn)
        a.add_handler(p.Events, self._events_request)

    @staticmethod
    def _guard(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # observing must never change what the daemon does
            log.exception("recording %s failed", fn.__name__)

    def _handled(self, req: p.Request, out: Outcome, dt: float, before: int,
                 sender: TenantRecord | None) -> None:
        t, reply = out.tenant or sender, out.reply
        if out.deferred:
            if isinstance(req, (p.Grant, p.Lease)) and t is not None:
                self._wait_began(t, req)
            return
        if isinstance(reply, p.Error):
            spec = bool(getattr(req, "speculative", False))
            self._error(t, "speculative" if spec else _op(req), reply, None)
        elif isinstance(reply, p.Claimed):  # a page handoff: pages moved, none granted
            self.events.record("handoff", t, reply.nfds * self.ps, giver=reply.giver,
                               group=reply.group, units=len(reply.units))
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
            self.events.record("deny", t, 0, **detail)

    def _wait_began(self, t: TenantRecord, req: p.Grant | p.Lease) -> None:
        w = self.arbiter.reclaimer.waiters[-1] if self.arbiter.reclaimer.waiters else None
        pages = w.pages if w is not None and w.req is req else 0
        now = time.monotonic()
        self._waiting[(t.id, req.id)] = (now, pages, _op(req))
        self.counts["waits"] += 1
        if self.round is None:
            self.round = Round(start=now, free_at_start=self.arbiter.pool.available * self.ps)
        self.round.waiters += 1
        self.events.record("wait", t, pages * self.ps, request=_op(req))

    def _ticked(self, outs: list[Outcome]) -> None:
        now = time.monotonic()
        for o in outs:
            t, reply = o.tenant, o.reply
            assert t is not None and reply is not None  # tick's outcomes have both
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

    def _asked(self, t: TenantRecord, msg: p.Reclaim) -> None:
        self.counts["asks", msg.mode] += 1
        self._answered[t.id] = 0
        if self.round is not None:
            self.round.asked[t.name] += msg.bytes
        self.events.record("ask", t, msg.bytes, mode=msg.mode, urgent=msg.urgent,
                           reason=msg.reason, seq=msg.seq)

    def _gave_back(self, t: TenantRecord, pages: int, mode: str) -> None:
        nbytes = pages * self.ps
        self._answered[t.id] += pages
        self.counts["reclaimed_bytes", t.name, mode] += nbytes
        if self.round is not None:
            self.round.answered[t.name] += nbytes
            self.round.by_mode[mode] += nbytes

    def _dropped(self, t: TenantRecord, why: str, held: int, arbitrated: bool,
                 dt: float) -> None:
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
        if rnd is None or self.arbiter.reclaimer.waiters:
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
    def _events_request(self, t: TenantRecord, identity: bytes,
                        r: p.Events) -> p.Reply | Outcome:
        reply = self.events.request(t.id, self.arbiter.envelope, r)
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
        live = self.arbiter.tenants.by_id
        for tid in [tid for tid in self.events.followers if tid not in live]:
            self.events.forget(tid)
        self.events.flush(self.server.reply)

    def snapshot(self) -> Snapshot:
        """The state now (loop thread only)."""
        a = self.arbiter
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

    def snapshot_from_loop(self, timeout_s: float | None = None) -> Snapshot | None:
        """From any other thread: a snapshot built by the loop at its next turn (or the
        last one, when the loop does not get to it within ``timeout_s``)."""
        with self._snap_lock:
            self._ready.clear()
            self._want = True
            self._poke()
            self._ready.wait(self.server.cfg.snapshot_timeout_s if timeout_s is None
                             else timeout_s)
            return self.last

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self.server.unwatch(self._wake_r)
        self._ready.set()
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def attach(server: Server) -> Observer:
    """Observe ``server``'s arbiter; serve ``/metrics`` when its config names an address
    (a refused or unusable address is a ``StartupError``)."""
    from kvpool.daemon import metrics
    from kvpool.daemon.server import StartupError

    obs = Observer(server)
    address = server.cfg.metrics_address
    if address:
        try:
            host, port = metrics.parse_address(address, bool(
                server.cfg.metrics_allow_remote))
            obs.exporter = metrics.Exporter(obs, host, port)
        except (ValueError, OSError) as e:
            obs.close()
            raise StartupError(f"cannot serve metrics: {e}") from None
        log.info("metrics on http://%s:%d/metrics", host, obs.exporter.port)
    return obs
