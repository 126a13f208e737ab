"""Outbound fd channel: a grant's descriptors, then its reply, without ever blocking.

Each tenant with something to send has a bounded :class:`fdqueue.Outbound`. An outcome
with pages queues its fd messages (at most :data:`fdchannel.MAX_FDS` descriptors each,
headed by ``FdHeader(request id, total, first)``) and then its reply; the queue is sent
while the socket takes it and waits for ``POLLOUT`` when it is full (the ordering rule:
a grant's descriptors are in the tenant's socket before its reply leaves). Pages become
descriptors only when sent, and only pages the tenant still owns are ever sent. A queue
over ``max_queued_fds`` drops the tenant; so does a socket that stays full for
``send_timeout_s`` (the server's timer, :meth:`FdSender.expire`).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Protocol, Union

from kvpool import fdchannel
from kvpool import protocol as p
from kvpool.daemon import fdqueue
from kvpool.daemon.fdwatch import FdWatch
from kvpool.daemon.outcome import Outcome
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import TenantRecord, Tenants

Reply = Callable[[list[bytes], Union[p.Reply, bytes]], None]  # send on the control socket
Drop = Callable[[TenantRecord, str], None]  # end a session (``Server.drop``)


class SharedPages(Protocol):
    """Pages a tenant holds without owning them (a weight set it holds:
    :class:`kvpool.daemon.weights.WeightSets`)."""

    def holds(self, tenant: int, pfn: int) -> bool:
        """Whether tenant ``tenant`` holds page ``pfn`` now (its descriptor may go)."""
        ...


class NoSharedPages:
    def holds(self, tenant: int, pfn: int) -> bool:
        return False


NO_SHARED_PAGES = NoSharedPages()


class FdSender:
    """Sends the pages of ``pools`` (by device: a tenant's pages are its device's) owned
    by live ``tenants`` (or ``shared`` pages they hold, by device) on their fd channels,
    waking on ``POLLOUT`` through ``fdwatch``; replies go out with ``reply`` after
    their descriptors, and a tenant whose queue overflows (``max_queued_fds``) or
    stays stuck (``send_timeout_s``) is ended with ``drop``."""

    def __init__(self, pools: Mapping[int, Pool], tenants: Tenants, fdwatch: FdWatch,
                 reply: Reply, drop: Drop, max_queued_fds: int, send_timeout_s: float,
                 shared: Mapping[int, SharedPages] | None = None):
        self.pools = pools
        self.shared: Mapping[int, SharedPages] = shared if shared is not None else {}
        self.tenants = tenants
        self.fdwatch = fdwatch
        self.reply = reply
        self.drop = drop
        self.max_queued_fds = max_queued_fds
        self.send_timeout_s = send_timeout_s
        self.queues: dict[int, fdqueue.Outbound] = {}  # tenant id -> messages still to send
        # (every device's backend is of one kind)
        self._handles_are_fds = next(iter(pools.values())).backend.caps.handles_are_fds

    def busy(self, t: TenantRecord) -> bool:
        """Something is still queued for ``t`` (its next request gets ``BUSY``)."""
        return bool(self.queues.get(t.id))

    def emit(self, envelope: list[bytes], req_id: int, out: Outcome) -> None:
        """Send one outcome: the grant's descriptors first (queued), then the reply."""
        t = out.tenant
        if t is not None and t.id in self.tenants.by_id and (
                out.pfns_to_send or self.queues.get(t.id)):
            q = self.queues.setdefault(t.id, fdqueue.Outbound(limit=self.max_queued_fds))
            pfns = out.pfns_to_send
            for first in range(0, len(pfns), fdchannel.MAX_FDS):
                header = p.encode(p.FdHeader(req_id, len(pfns), first))
                q.push_fds(header, pfns[first : first + fdchannel.MAX_FDS])
            q.push_reply(envelope, p.encode(out.reply), out.end_session)
            if q.overflowing:
                self.drop(t, f"{q.fds} descriptors queued on its fd channel")
                return
            self.flush(t)
            return
        if out.pfns_to_send:  # the session ended while the grant waited: nothing to pair it with
            self.reply(envelope, p.error(req_id, p.BUSY, "the session was dropped"))
            return
        assert out.reply is not None
        self.reply(envelope, out.reply)
        if out.end_session and t is not None:
            self.drop(t, "said bye")

    def flush(self, t: TenantRecord) -> None:
        """Send ``t``'s queued messages while its socket takes them (never blocking);
        wait for ``POLLOUT`` when it is full. Replies leave only after the descriptors
        queued before them (the ordering rule)."""
        q = self.queues.get(t.id)
        while q:
            item = q.items[0]
            if isinstance(item, fdqueue.QueuedReply):
                q.pop()
                self.reply(item.envelope, item.frame)
                if item.end_session:
                    self.drop(t, "said bye")
                    return
                continue
            try:
                sent = self._send_message(t, item)
            except Exception as e:  # the socket failed, or exporting a page did (a bug)
                self.drop(t, f"fd channel send failed: {type(e).__name__}: {e}")
                return
            if not sent:
                if q.stuck_since is None:
                    q.stuck_since = time.monotonic()
                self.fdwatch.want_write(t.conn.fileno(), True)
                return
            q.pop()
        self.queues.pop(t.id, None)
        self.fdwatch.want_write(t.conn.fileno(), False)

    def _send_message(self, t: TenantRecord, item: fdqueue.FdMessage) -> bool:
        """One fd message; False when the socket is full. Only pages ``t`` still owns
        are ever sent (a queued pfn it gave back meanwhile is a bug: the tenant drops)."""
        pool = self.pools[t.device]
        backend, shared = pool.backend, self.shared.get(t.device, NO_SHARED_PAGES)
        if any(pool.owner.get(pfn) != t.id and not shared.holds(t.id, pfn)
               for pfn in item.pfns):
            raise OSError("a queued page is no longer this tenant's")
        if self._handles_are_fds:
            # host pages are memfds already: SCM_RIGHTS copies them, no dup needed
            fds, owned = [pool.pages[pfn].handle for pfn in item.pfns], False
        else:
            fds, owned = [backend.export(pool.pages[pfn]) for pfn in item.pfns], True
        try:
            fdchannel.send_fds(t.conn, item.header, fds)
        except (BlockingIOError, InterruptedError):
            return False
        finally:
            if owned:
                fdchannel.close_all(fds)
        return True

    def next_deadline(self) -> float | None:
        stuck = [q.stuck_since for q in self.queues.values() if q.stuck_since is not None]
        return min(stuck) + self.send_timeout_s if stuck else None

    def expire(self, now: float) -> None:
        """Drop tenants whose fd socket stayed full for ``send_timeout_s``."""
        timeout = self.send_timeout_s
        for tid, q in list(self.queues.items()):
            t = self.tenants.by_id.get(tid)
            if t is not None and q.stuck_since is not None and now - q.stuck_since >= timeout:
                self.drop(t, f"fd channel full for {timeout:g} s ({q.fds} descriptors queued)")

    def forget(self, t: TenantRecord) -> None:
        self.queues.pop(t.id, None)
