"""Who may make an elastic server retire (``POST /pd/retire``, :mod:`.app`):
only the tenant named in the body's ``to``, decided from identity, never from what the
caller says (docs/THREAT-MODEL.md "Who may ask a server to retire").

:func:`admit` runs before anything is detached, offered or held; a refusal is
:class:`Refused` (an HTTP status and one line) and the server keeps serving untouched:

1. ``ttl_s`` is in ``MIN_TTL_S..MAX_TTL_S`` (else 400): a retire holds new requests until
   the ticket settles, so the caller may not choose to hold them for an hour;
2. this server's tenant asks the daemon where ``to`` runs (``Locate(to, as_giver=True)``):
   answered only when this tenant may hand pages to it — the escrow's rule, same uid or
   ``[tenants.THIS] handoff_to = ["TO"]`` — with its pid from ``SO_PEERCRED`` (else 403);
3. the HTTP peer is that pid: the request's TCP connection (the client's address and
   port towards this server's) must be a loopback socket open in process ``pid``, seen
   through ``/proc`` (psutil). A socket of another uid cannot be seen by a non-root
   server; then it refuses (403: it cannot tell who asks), it never guesses;
4. the ``url`` this server will relay its clients to (in-flight handover) is the endpoint
   ``to`` registered with the daemon (else 403): even the right tenant cannot send this
   server's clients' requests anywhere else.

The identity is bound to the connection the request came on: a process that is not the
tenant cannot borrow it by naming it, by sending from a port it chose, or by racing the
check (the connection is established and open while the request is handled).
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import psutil

from kvpool.engine_adapters.bundled.bridge import bridge_of

MIN_TTL_S = 1.0  # a retire ticket lives at least this long (the claim needs a moment)
MAX_TTL_S = 60.0  # and at most this: new requests wait while it is out


class Refused(Exception):
    """A retire refused: ``status`` (400 or 403) and one line."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status, self.line = status, line


async def admit(engine: Any, to: str, ttl_s: float, peer: tuple[str, int] | None,
                server: tuple[str, int] | None, url: str | None = None) -> None:
    """Refuse (:class:`Refused`) unless tenant ``to`` itself, connected from ``peer`` to
    ``server`` (the request's TCP addresses), may have ``engine``'s server retire
    towards it for ``ttl_s`` seconds, relaying to ``url`` (its registered endpoint).
    Changes nothing. (The daemon call and the /proc scan run off the event loop.)
    A tensor-parallel engine is refused (409): its KV lives on every rank, and only
    rank 0's pages could change hands."""
    if getattr(engine, "workers", None) is not None:
        raise Refused(409, "retire refused: a tensor-parallel engine's KV lives on every "
                           "rank; it cannot be handed over")
    check_ttl(ttl_s)
    await asyncio.to_thread(check_peer, engine, to, peer, server, url)


def check_ttl(ttl_s: float) -> None:
    if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise Refused(400, f"ttl_s {ttl_s:g} is not in {MIN_TTL_S:g}..{MAX_TTL_S:g} s")


def check_local_peer(what: str, peer: tuple[str, int] | None,
                     server: tuple[str, int] | None
                     ) -> tuple[tuple[str, int], tuple[str, int]]:
    """(peer, server) when the request came on a TCP connection ``peer`` -> ``server``
    from this machine's loopback; else :class:`Refused` (403), its line led by ``what``."""
    if peer is None or server is None:
        raise Refused(403, f"{what}: the request came on no TCP connection this server "
                           f"can check")
    if not loopback(peer[0]):
        raise Refused(403, f"{what}: the request came from {peer[0]}, not from this "
                           f"machine's loopback")
    return peer, server


def check_peer(engine: Any, to: str, peer: tuple[str, int] | None,
               server: tuple[str, int] | None, url: str | None = None) -> None:
    """Tenant ``to`` may receive this server's pages, the connection ``peer`` ->
    ``server`` is open in its process and ``url`` (if any) is its registered endpoint;
    else :class:`Refused` (403)."""
    peer, server = check_local_peer(f"retire to {to!r} refused", peer, server)
    pid, endpoint = _locate(engine, to)
    if url is not None and url.rstrip("/") != (endpoint or "").rstrip("/"):
        raise Refused(403, f"retire to {to!r} refused: url {url[:80]!r} is not the endpoint "
                           f"tenant {to!r} registered ({endpoint or 'none'})")
    check_connection(to, pid, peer, server)


def check_connection(to: str, pid: int, peer: tuple[str, int],
                     server: tuple[str, int], action: str | None = None) -> None:
    """The TCP connection ``peer`` -> ``server`` is open in process ``pid`` (tenant
    ``to``'s); else :class:`Refused` (403), also when this process cannot see its
    sockets (another uid, this one not root). ``action`` names what is refused in the
    line (default: the retire to ``to``)."""
    what = action or f"retire to {to!r}"
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        raise Refused(403, f"{what} refused: its process {pid} is gone") from None
    except psutil.AccessDenied:
        raise Refused(403, f"{what} refused: its process {pid} runs as another "
                           f"user, whose sockets this server cannot see, so it cannot tell "
                           f"who asks (run the old server as root, or the new one as this "
                           f"server's user)") from None
    if not any(_same(c, peer, server) for c in conns):
        raise Refused(403, f"{what} refused: the request did not come from "
                           f"tenant {to!r}'s process {pid} (it came from port {peer[1]})")


def _locate(engine: Any, to: str) -> tuple[int, str | None]:
    """The pid and registered endpoint of live tenant ``to``, if this server's tenant
    may hand pages to it."""
    from kvpool.client_lib import KvpoolError

    bridge = bridge_of(engine)
    tenant = bridge.tenant if bridge is not None else None
    if tenant is None:
        raise Refused(403, f"retire to {to!r} refused: this server has no kvpool tenant")
    try:
        found = tenant.locate(to, as_giver=True)
        return int(found.pid), found.endpoint or None
    except KvpoolError as e:
        raise Refused(403, f"retire to {to!r} refused: {e.message}") from None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        a = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def loopback(host: str) -> bool:
    a = _ip(host)
    return a is not None and a.is_loopback


def _same(c: Any, peer: tuple[str, int], server: tuple[str, int]) -> bool:
    """Whether socket ``c`` (of the process checked) is the client end of the
    connection ``peer`` -> ``server``."""
    if c.status != psutil.CONN_ESTABLISHED or not c.laddr or not c.raddr:
        return False
    return (c.laddr.port == peer[1] and c.raddr.port == server[1]
            and _ip(c.laddr.ip) == _ip(peer[0]) and _ip(c.raddr.ip) == _ip(server[0]))


async def refusal(engine: Any, to: str, ttl_s: float, request: Any,
                  url: str | None = None) -> Any:
    """For the ``/pd/retire`` route: None when :func:`admit` lets the request through,
    else the JSON error response (``{"error": {"message", "type", "code"}}``)."""
    from fastapi.responses import JSONResponse

    try:
        await admit(engine, to, ttl_s, address(request.client),
                    address(request.scope.get("server")), url)
    except Refused as e:
        code = "forbidden" if e.status == 403 else "invalid_request"
        return JSONResponse({"error": {"message": e.line, "type": "invalid_request_error",
                                       "code": code}}, e.status)
    return None


def address(a: Any) -> tuple[str, int] | None:
    return None if a is None else (str(a[0]), int(a[1]))
