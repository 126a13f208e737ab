"""A tenant: one process's registered session with the daemon.

``connect(name=...)`` opens the fd channel (the daemon reads our pid/uid there and hands
out a session token), registers over ZeroMQ, and opens this process's own vmm backend of
the daemon's kind and page size. Closing (or leaving the ``with`` block) releases every
unit of every group and ends the session; if the process dies instead, the daemon sees
the fd channel close and takes everything back itself.

A background thread (the *keeper*) sleeps until the daemon's unsolicited messages arrive
(:meth:`Connection.wait_message`, at most ``POLL_S``), so reclaim requests reach even a
tenant whose own threads do nothing, at once:

* ``Reclaim(mode="reserve")`` — release empty chunks of the allocators' reserves;
* ``Reclaim(mode="shrink")`` — the same, then the shrink callback (see
  :meth:`Tenant.set_shrink_callback`) frees blocks and the chunks that became empty are
  released, repeated until enough is free or the deadline nears; then ``Reclaimed``;
* ``SleepAsk`` — the engine's sleep handler (:meth:`Tenant.set_sleep_handler`) runs on a
  worker thread (:mod:`kvpool.client_lib.sleep_handler`) and the new state is reported
  (:meth:`Tenant.report_state`); without a handler the ask is ignored (logged).

The keeper also notices the daemon's death (fd-channel EOF). The tenant keeps serving
with the pages it maps, reconnects with backoff, registers again and *adopts*: it sends
every group's mapped units with their page descriptors, so the new daemon owns the pages
again and rebuilds its accounting (host: the page memfds the group keeps; CUDA: handles
retained from the mappings with ``cuMemRetainAllocationHandle`` and re-exported).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar, overload

from kvpool import paths
from kvpool import protocol as p
from kvpool.client_lib.connection import Connection, UntrustedDaemon
from kvpool.client_lib.errors import KvpoolError
from kvpool.client_lib.handoff import Handoffs
from kvpool.client_lib.lease import Lease
from kvpool.client_lib.regions import RegionGroup
from kvpool.client_lib.sleep_handler import SleepHandler, SleepWorker
from kvpool.limits import raise_fd_limit
from kvpool.vmm import open_backend

log = logging.getLogger("kvpool.client")

POLL_S = 0.1  # the keeper's longest sleep: it looks for the daemon's death this often
SHRINK_ROUNDS = 4  # shrink callback calls per reclaim at most
ShrinkCallback = Callable[[int, bool], None]
R = TypeVar("R", bound=p.Reply)


class Tenant:
    def __init__(self, name: str, device: int = 0, run_dir: str | os.PathLike[str] | None = None,
                 kind: p.Kind = "engine", timeout_s: float = 10.0, *, min: int | None = None,
                 max: int | None = None, shares: float | None = None, keeper: bool = True,
                 endpoint: str | None = None, sleepable: bool | None = None,
                 group: str | None = None, gang: str | None = None,
                 rank: int | None = None,
                 layout: Sequence[tuple[int, int]] | None = None,
                 engine: p.EngineType | None = None):
        self.run_dir = paths.run_dir(run_dir)
        self.timeout_s = timeout_s
        raise_fd_limit()  # host tenants keep one descriptor per mapped page
        self.conn = Connection(Path(self.run_dir), timeout_s=timeout_s)
        self.closed = False
        try:
            hello = self.conn.hello
            assert hello is not None
            self._register = p.Register(
                name=name, kind=kind, device=device, min=min, max=max, shares=shares,
                endpoint=endpoint, sleepable=sleepable, group=group, gang=gang, rank=rank,
                layout=gang_layout(layout, hello.page_size) if layout is not None else None,
                engine=engine)
            reply, _ = self.conn.call(self._fresh_register(), p.Registered)
            self.backend = open_backend(hello.backend, device, hello.page_size)
        except BaseException:
            self.conn.close()
            raise
        self.info: p.Registered = reply
        self.id = reply.tenant
        self.name = name
        self.kind = kind
        self.device = device
        self.page_size = reply.page_size
        self.limit = reply.limit
        self.budget = reply.budget
        self.groups: dict[int, RegionGroup] = {}
        self.gang_id = reply.gang_id  # the gang this session is a rank of (0: none)
        self.rank = reply.rank
        self.gang_ended: str | None = None  # why the gang ended (GangEnded), None: it lives
        self.on_gang_end: Callable[[str], None] | None = None  # (reason), keeper thread
        self.on_message: Callable[[p.Reply], None] | None = None
        self.handoffs = Handoffs(self)  # offers in flight (kvpool.client_lib.handoff)
        self.lease_bytes = 0
        self.reconnects = 0
        self.reclaims = 0  # reclaim requests handled
        self._shrink: ShrinkCallback | None = None
        self._sleep_handler: SleepHandler | None = None
        self._sleep = SleepWorker(self.report_state, name=f"kvpool-sleep-{name}")
        self._state_lock = threading.Lock()
        self._state: str | None = None  # what we last said (TenantState), None: never
        self._state_sent = True  # False: the daemon has not heard ``_state`` yet
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if keeper:
            self._keeper = threading.Thread(target=self._keep, name=f"kvpool-tenant-{name}",
                                            daemon=True)
            self._keeper.start()

    def _fresh_register(self) -> p.Register:
        r = self._register
        return p.Register(name=r.name, kind=r.kind, device=r.device, min=r.min, max=r.max,
                          shares=r.shares, endpoint=r.endpoint, sleepable=r.sleepable,
                          group=r.group, gang=r.gang, rank=r.rank, layout=r.layout,
                          engine=r.engine)

    # ---- gangs (tensor parallelism: docs/ARCHITECTURE.md, "Gangs") -------------------
    def create_gang(self, devices: Sequence[int],
                    layout: Sequence[tuple[int, int]]) -> str:
        """Make this session rank 0 of a new gang of ``len(devices)`` ranks (rank ``r``
        on ``devices[r]``; ``devices[0]`` must be this session's device) whose ranks
        each create the groups of ``layout`` (``(n_regions, capacity_bytes)`` each, in
        order; capacities are rounded up to pages as ``region_group`` does). Returns the
        gang token the other ranks join with (``connect(..., gang=token, rank=r,
        layout=layout)``): a capability, pass it privately. From then on this session's
        grants and releases are collective (every rank sends the same one)."""
        reply, _ = self.conn.call(p.CreateGang(
            devices=list(devices), layout=gang_layout(layout, self.page_size)),
            p.GangCreated)
        self.gang_id, self.rank = reply.gang_id, 0
        return reply.gang

    @property
    def connected(self) -> bool:
        return not self.conn.daemon_gone and not self.closed

    @overload
    def call(self, req: p.Request) -> tuple[p.Reply, list[int]]: ...

    @overload
    def call(self, req: p.Request, expect: type[R]) -> tuple[R, list[int]]: ...

    def call(self, req: p.Request, expect: type[p.Reply] = p.Reply) -> tuple[p.Reply, list[int]]:
        """One request on this session's connection (see :meth:`Connection.call`).

        A grant waits at most this session's timeout, not the daemon's longer hold: the
        connection carries one request at a time, and this session's thread must stay
        able to answer the daemon's reclaims meanwhile (a held grant would block the
        very shrink that could free its memory). A grant given up on that the daemon
        serves later is given back by the connection."""
        bounded = self.conn.timeout_ms if isinstance(req, p.Grant) else None
        return self.conn.call(req, expect, timeout_ms=bounded)

    def region_group(self, n_regions: int, capacity_bytes: int, label: str = "",
                     chunk_units: int = 1) -> RegionGroup:
        """Reserve ``n_regions`` ranges of ``capacity_bytes`` (rounded up to pages) each
        and register them with the daemon; nothing is mapped yet. ``chunk_units``: the
        units its allocator grants and releases together (what ``ps`` shows)."""
        g = RegionGroup(self, n_regions, capacity_bytes, label, chunk_units)
        self.groups[g.id] = g
        return g

    def group_closed(self, group_id: int) -> None:
        """(:meth:`RegionGroup.close`) The group is gone: no longer one of ``groups``."""
        self.groups.pop(group_id, None)

    # ---- reclaim ---------------------------------------------------------------------
    def set_shrink_callback(self, fn: ShrinkCallback | None) -> None:
        """Register ``fn(nbytes, urgent)``: the daemon wants ``nbytes`` more back than the
        reserves held (this tenant is above its weighted fair share, or above a lowered
        ``max``).

        The callback frees KV blocks through the allocator (``ElasticBlockAllocator.free``),
        cheapest first: cached prefix blocks, page-aware so whole chunks empty
        (``held_by_chunk()`` tells which chunks are nearly empty; ``holdings()`` what is
        held). When ``urgent`` is True the memory must go (deadline near, or above the
        limit): the engine may preempt running requests. After each call the library
        releases the chunks that became empty and, if still short, calls again (at most
        ``SHRINK_ROUNDS`` times, until the deadline nears), then answers the daemon.

        Thread safety: ``fn`` runs on the tenant's background thread, concurrently with the
        engine's own threads. It must synchronise with the engine's step loop itself (for
        example take the scheduler's lock, or hand the work to the step loop and wait
        briefly); ``ElasticBlockAllocator.free`` is thread-safe. It should return within
        the reclaim deadline (about a second) and must not call into this Tenant's
        reclaim machinery. Exceptions are logged and end this reclaim."""
        self._shrink = fn

    def poll(self) -> list[p.Reply]:
        """Handle unsolicited messages from the daemon (the keeper thread calls this).
        Each goes to ``on_message`` when set; otherwise :meth:`handle_message`."""
        msgs = self.conn.poll()
        for m in msgs:
            if self.on_message is not None:
                self.on_message(m)
            else:
                self.handle_message(m)
        return msgs

    def handle_message(self, m: p.Reply) -> None:
        if isinstance(m, p.Reclaim):
            self.reclaim(m)
        elif isinstance(m, p.Settled):  # an offer of ours ended (kvpool.client_lib.handoff)
            self.handoffs.settled(m)
        elif isinstance(m, p.SleepAsk):  # (kvpool.client_lib.sleep_handler)
            self._sleep.ask(m, self._sleep_handler)
        elif isinstance(m, p.GangEnded):  # a rank's session ended: our pages went back
            self._gang_over(m.gang_id, m.reason)

    def _gang_over(self, gang_id: int, reason: str) -> None:
        self.gang_ended = reason
        log.warning("gang %d ended: %s", gang_id or self.gang_id, reason)
        if self.on_gang_end is not None:
            self.on_gang_end(reason)

    # ---- sleep and wake ---------------------------------------------------------------
    def set_sleep_handler(self, handler: SleepHandler | None) -> None:
        """Run ``handler.sleep``/``wake`` when the daemon asks (``kvpool sleep|wake``,
        or memory pressure when this tenant is ``sleepable`` and says ``idle``); on a
        worker thread, never the keeper. None: asks are ignored."""
        self._sleep_handler = handler

    def report_state(self, state: str, reason: str | None = None) -> None:
        """Tell the daemon this tenant is ``busy``, ``idle`` or ``asleep`` (only when it
        changed); ``reason`` (one of ``p.SLEEP_REASONS``, others are left out): why it
        went to sleep or woke, for the daemon's event log. Thread-safe; never raises for
        a gone daemon (the state is sent again after a reconnect). ``ValueError`` for any
        other state."""
        if state not in p.SLEEP_STATES:
            raise ValueError(f"state {state!r} is not one of {', '.join(p.SLEEP_STATES)}")
        why = reason if reason in p.SLEEP_REASONS else None
        with self._state_lock:
            if state == self._state and self._state_sent:
                return
            self._state, self._state_sent = state, False
            if self.closed:
                return
            try:
                self.conn.call(p.TenantState(state=state, reason=why), p.Done)
                self._state_sent = True
            except KvpoolError as e:
                log.debug("state %s not sent (sent after a reconnect): %s", state, e)

    @property
    def state(self) -> str | None:
        """What this tenant last said it is doing (None: never said)."""
        return self._state

    def reclaim(self, m: p.Reclaim) -> int:
        """Answer one reclaim request; returns the bytes released."""
        self.reclaims += 1
        window = (m.deadline_ms / 1000 if m.deadline_ms else 2.0)
        start = time.monotonic()
        deadline = start + window * 0.8
        freed = self.reclaim_reserve(m.bytes)
        rounds = 0
        while (m.mode == "shrink" and self._shrink is not None and freed < m.bytes
               and rounds < SHRINK_ROUNDS and time.monotonic() < deadline):
            urgent = m.urgent or (rounds > 0 and time.monotonic() - start > window / 2)
            try:
                self._shrink(m.bytes - freed, urgent)
            except Exception:
                log.exception("shrink callback failed")
                break
            got = self.reclaim_reserve(m.bytes - freed)
            freed += got
            rounds += 1
            if got == 0 and rounds >= 2:
                break
        if m.seq:
            with contextlib.suppress(KvpoolError):
                self.conn.call(p.Reclaimed(seq=m.seq, freed=min(freed, p.MAX_BYTES)), p.Done)
        log.debug("reclaim %d (%s, %s): %d of %d bytes released", m.seq, m.mode, m.reason,
                  freed, m.bytes)
        return freed

    def reclaim_reserve(self, nbytes: int) -> int:
        """Release up to ``nbytes`` of empty chunks (rounded up to whole chunks) from
        every group's allocator; returns the bytes released."""
        freed = 0
        for g in list(self.groups.values()):
            if freed >= nbytes:
                break
            if g.allocator is not None:
                freed += g.allocator.release_reserve(nbytes - freed)
        return freed

    # ---- leases -----------------------------------------------------------------------
    def lease(self, nbytes: int) -> Lease:
        """Hold ``nbytes`` (rounded up to pages) against the budget for memory this process
        uses through its own allocator. The daemon reclaims from other tenants to make
        room (and on CUDA checks the device's real free memory); raises ``NoMemory`` when
        it cannot within its deadline. Ends with ``Lease.close()`` or with the process."""
        reply, _ = self.conn.call(p.Lease(bytes=nbytes), p.Leased,
                                  timeout_ms=int(self.timeout_s * 1000))
        self.lease_bytes = reply.bytes
        return Lease(self, reply.bytes)

    def set_lease(self, nbytes: int) -> int:
        reply, _ = self.conn.call(p.Lease(bytes=nbytes), p.Leased)
        self.lease_bytes = reply.bytes
        return self.lease_bytes

    # ---- the keeper thread: messages, daemon liveness, reconnect ------------------------
    def _keep(self) -> None:
        next_probe = 0.0
        while not self._stop.is_set():
            self.conn.wait_message(POLL_S)  # returns early for a message or close()
            if self._stop.is_set() or self.closed:
                return
            try:
                now = time.monotonic()
                if now >= next_probe:
                    next_probe = now + POLL_S
                    self.conn.daemon_alive()
                if self.conn.daemon_gone:
                    if self.gang_id:  # a restart ends every gang: nothing to adopt
                        self._gang_over(0, "the daemon went away")
                        return
                    self._reconnect()
                    continue
                self.poll()
            except KvpoolError as e:
                if not self.closed and not self.conn.daemon_gone:
                    log.warning("tenant thread: %s", e)
            except Exception:
                if not self.closed:
                    log.exception("tenant thread")

    def _reconnect(self) -> None:
        """The daemon is gone: reconnect with backoff, register again, adopt our pages."""
        delay = 0.05
        log.warning("kvpool daemon gone; serving from mapped pages and reconnecting")
        warned = False
        while not self._stop.is_set() and not self.closed:
            try:
                conn = Connection(Path(self.run_dir), timeout_s=self.timeout_s)
            except KvpoolError as e:
                if isinstance(e, UntrustedDaemon) and not warned:
                    log.error("%s; not reconnecting to it (retrying until a trusted daemon "
                              "serves %s)", e.message, self.run_dir)
                    warned = True
                self._stop.wait(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                self._rejoin(conn)
                return
            except (KvpoolError, OSError) as e:
                log.warning("re-registering failed: %s", e)
                conn.close()
                self._stop.wait(delay)
                delay = min(delay * 2, 1.0)

    def _rejoin(self, conn: Connection) -> None:
        reply, _ = conn.call(self._fresh_register(), p.Registered)
        groups = list(self.groups.values())
        with contextlib.ExitStack() as frozen:
            for g in groups:  # no unit maps or unmaps while the new daemon adopts them
                frozen.enter_context(g.frozen())
            owned: list[int] = []
            try:
                entries: list[p.AdoptGroup] = []
                fds: list[int] = []
                for g in groups:
                    entry, gfds, gowned = g.adopt_state()
                    entries.append(entry)
                    fds.extend(gfds)
                    owned.extend(gowned)
                conn.call(p.Adopt(groups=entries, lease=self.lease_bytes, nfds=len(fds)),
                          p.Adopted, fds_ahead=fds)
                old, self.conn = self.conn, conn
            finally:
                for fd in owned:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        old.close()
        self.info = reply
        self.id = reply.tenant
        with self._state_lock:  # the new daemon has not heard our state
            if self._state is not None:
                try:
                    conn.call(p.TenantState(state=self._state), p.Done)  # type: ignore[arg-type]
                    self._state_sent = True
                except KvpoolError as e:
                    self._state_sent = False
                    log.warning("state %s not sent after reconnecting: %s", self._state, e)
        self.reconnects += 1
        self.handoffs.void("the daemon restarted")  # the new daemon knows no ticket
        log.warning("reconnected to the kvpool daemon as tenant %d; adopted %d groups",
                    self.id, len(entries))

    # ---- misc ----------------------------------------------------------------------------
    def ping(self) -> None:
        self.conn.call(p.Ping(), p.Done)

    def room(self) -> p.RoomReply:
        """What the daemon would grant this session at once and its knobs (``Room``);
        waits behind a call of another thread on this connection (one lock)."""
        return self.conn.call(p.Room(), p.RoomReply)[0]

    def locate(self, name: str, as_giver: bool = False) -> p.Located:
        """The live tenant ``name`` (pid, uid, endpoint), if it may hand pages to this
        one — with ``as_giver``: if this one may hand pages to it — (kvpool.daemon.locate);
        else raises ``KvpoolError`` (``NOT_FOUND``)."""
        return self.conn.call(p.Locate(name=name, as_giver=as_giver), p.Located)[0]

    def close(self) -> None:
        if self.closed:
            return
        self._stop.set()
        self.conn.wake()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join()
        self._sleep.join(self.timeout_s)
        try:
            for g in list(self.groups.values()):
                try:  # a gang's groups end with the gang (bye), never one by one
                    g.close(tell_daemon=not self.gang_id)
                except Exception:
                    log.exception("closing group %d failed", g.id)
            try:
                self.conn.call(p.Bye(), p.Done)
            except Exception as e:  # the daemon may be gone; EOF tells it anyway
                log.debug("bye failed: %s", e)
        finally:
            self.closed = True
            self.conn.close()
            self.backend.close()

    def __enter__(self) -> "Tenant":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gang_layout(layout: Sequence[tuple[int, int]], page_size: int) -> list[p.GangGroup]:
    """``(n_regions, capacity_bytes)`` pairs as the wire's layout, capacities rounded
    up to whole pages (as :class:`RegionGroup` reserves them)."""
    return [p.GangGroup(n_regions=n, capacity=-(-c // page_size) * page_size)
            for n, c in layout]


def connect(name: str, device: int = 0, run_dir: str | os.PathLike[str] | None = None,
            kind: p.Kind = "engine", timeout_s: float = 10.0, *, min: int | None = None,
            max: int | None = None, shares: float | None = None,
            endpoint: str | None = None, sleepable: bool | None = None,
            group: str | None = None, gang: str | None = None, rank: int | None = None,
            layout: Sequence[tuple[int, int]] | None = None,
            engine: p.EngineType | None = None) -> Tenant:
    """Register with the daemon serving ``run_dir`` (see :mod:`kvpool.paths`). ``min``,
    ``max`` (bytes) and ``shares`` (its part of contended memory) are this tenant's own
    knobs, used unless the daemon's config names it (the config and live admin changes
    win); ``endpoint`` is where it serves (loopback http, :mod:`kvpool.protocol.endpoint`),
    for ``locate``;
    ``sleepable``: the daemon may put it to sleep when it is idle and memory is short
    (the config's ``[tenants.NAME] sleepable`` wins; :meth:`Tenant.set_sleep_handler`);
    ``group``: a label shown by ``kvpool ps`` (a fleet's name, ``KVPOOL_GROUP``).
    ``gang``, ``rank``, ``layout``: join the gang (tensor parallelism) whose rank 0 got
    token ``gang`` from :meth:`Tenant.create_gang`, as rank ``rank`` on ``device``, with
    the gang's ``layout`` (docs/ARCHITECTURE.md, "Gangs"). ``engine``: the metrics
    dialect ``endpoint`` serves (``vllm`` or ``kvpool``), the router's engine type in a
    daemon's endpoints file."""
    return Tenant(name, device=device, run_dir=run_dir, kind=kind, timeout_s=timeout_s,
                  min=min, max=max, shares=shares, endpoint=endpoint, sleepable=sleepable,
                  group=group, gang=gang, rank=rank, layout=layout, engine=engine)
