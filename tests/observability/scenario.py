"""A daemon with two tenants that answer reclaim, and a lease that forces a reclaim."""

from __future__ import annotations

from daemon.helpers import PAGE, read_event

from .helpers import free_port, spawn_idle

BUDGET_PAGES = 32
SHORT_PAGES = 8  # the lease asks for this much more than is free


def start(start_daemon, metrics: bool = True):
    """``(daemon, port)``: alpha and beta hold 10 blocks each (64 KiB = one page)."""
    port = free_port() if metrics else None
    extra = ("--metrics-address", f"127.0.0.1:{port}") if metrics else ()
    d = start_daemon(budget=f"{BUDGET_PAGES * PAGE}", extra=extra)
    for name in ("alpha", "beta"):
        read_event(spawn_idle(d, name, 10), "ready")
    return d, port


def available(d) -> int:
    pool = d.cli_json("ps")["pool"]
    return pool["budget"] - pool["granted"] - pool["leased"] - pool["retained"]


def force_reclaim(d):
    """Lease what is free plus :data:`SHORT_PAGES`; returns ``(tenant, lease bytes, free)``."""
    free = available(d)
    job = d.connect("job", kind="lease")
    nbytes = free + SHORT_PAGES * PAGE
    job.lease(nbytes)
    return job, nbytes, free
