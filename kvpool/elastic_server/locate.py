"""Finding the server to take over by its tenant name (``kvpool serve MODEL --elastic
--handoff-from TENANT``; docs/PD-HANDOFF.md "Warm restart").

* :func:`announce`: an elastic server's tenant registers the loopback endpoint it serves
  on (``Register.endpoint``), so that a successor can find it through the daemon;
* :func:`resolve`: the new server, once its own tenant is registered, asks the daemon
  where tenant ``TENANT`` serves (``Locate``: answered only when that tenant may hand
  pages to this one, the handoff rule) and returns its URL. A source that already is a
  URL (``http://``, ``https://``) is returned as it is.

The endpoint is what the old tenant said; the daemon vouches for its name and pid only.
So before anything is sent there, :func:`check_listener` looks (psutil) at who listens
on that port: nobody — a dead endpoint, refused; a process this user can see that is not
the located tenant's pid — refused (it would be asking someone else to retire); a
listener whose pid this user cannot see (another uid) — allowed, the escrow's claim
rules still decide what may move. Every refusal is a ``RuntimeError`` with one line
(``kvpool serve`` prints it and exits nonzero); nothing has been adopted by then.

Whatever answers there, the cache it hands over must be the located tenant's: resolve
makes this tenant's next claim name that tenant's id (``Claim.giver``,
:meth:`~kvpool.client_lib.handoff.Handoffs.expect_giver`), and the daemon refuses a
ticket another tenant offered — nothing is claimed or adopted, the new server exits
with that one line.
"""

from __future__ import annotations

import logging
from typing import Any

import psutil

from kvpool.engine_adapters.bundled.bridge import BundledBridge
from kvpool import protocol as p
from kvpool.protocol import endpoint

log = logging.getLogger("kvpool.warm")


def is_url(source: str) -> bool:
    """``--handoff-from`` names a server by URL (else it is a tenant name)."""
    return source.startswith(("http://", "https://"))


def announce(bridge: BundledBridge, host: str, port: int) -> str | None:
    """Make the bridge's tenant (its engine not built yet) register the endpoint a server
    bound to ``host``:``port`` has on loopback; returns it (None: not on loopback, none
    sent)."""
    url = endpoint.for_listener(host, port)
    bridge.settings.endpoint = url
    if url is None:
        log.warning("serving on %s, not on loopback: no endpoint registered, so no "
                    "successor can find this server by its tenant name", host)
    return url


def resolve(bridge: BundledBridge | None, source: str) -> str:
    """The URL of the server ``source`` names (a URL, or a tenant name located through
    the daemon by ``bridge``'s registered tenant). Raises RuntimeError (one line)."""
    if is_url(source):
        return source
    tenant: Any = bridge.tenant if bridge is not None else None
    if tenant is None:
        raise RuntimeError(f"--handoff-from {source}: this server has no kvpool tenant "
                           f"to locate it with (needs --elastic)")
    from kvpool.client_lib import KvpoolError

    try:
        found: p.Located = tenant.locate(source)
    except KvpoolError as e:
        raise RuntimeError(f"--handoff-from {source}: {e.message}") from None
    if not found.endpoint:
        raise RuntimeError(f"--handoff-from {source}: tenant {source!r} (pid {found.pid}) "
                           f"registered no endpoint (not an elastic server on loopback?)")
    why = endpoint.why_not(found.endpoint)  # the daemon checked; a successor checks too
    if why:
        raise RuntimeError(f"--handoff-from {source}: {why}")
    check_listener(source, found.pid, endpoint.port_of(found.endpoint))
    from kvpool.client_lib import handoff

    handoff.of(tenant).expect_giver(found.tenant)  # what we claim next must be its offer
    log.warning("tenant %s (pid %d) serves at %s", source, found.pid, found.endpoint)
    return found.endpoint


def listeners(port: int) -> set[int | None]:
    """Pids listening on TCP ``port`` (None for a socket whose owner this user cannot
    see); empty when nothing listens there."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:  # (not on Linux: /proc/net/tcp is readable by all)
        return {None}
    return {c.pid for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def check_listener(name: str, pid: int, port: int) -> None:
    """Refuse (RuntimeError) unless tenant ``name``'s ``pid`` may be what listens on
    ``port``: someone listens, and no visible listener is another process."""
    pids = listeners(port)
    if not pids:
        raise RuntimeError(f"--handoff-from {name}: nothing listens on port {port}, the "
                           f"endpoint tenant {name!r} (pid {pid}) registered")
    if pid not in pids and None not in pids:
        other = ", ".join(str(x) for x in sorted(x for x in pids if x is not None))
        raise RuntimeError(f"--handoff-from {name}: port {port} is served by pid {other}, "
                           f"not by tenant {name!r}'s pid {pid}; not asking it to retire")
