"""The endpoint a tenant may register (``Register.endpoint``): where it serves, so that a
successor it may hand pages to can find it (``Locate``; docs/PD-HANDOFF.md "Warm
restart").

Only loopback HTTP URLs are accepted, and only in one spelling: ``http://HOST:PORT``
with ``HOST`` one of ``127.x.y.z`` (decimal octets without leading zeros), ``[::1]`` or
``localhost`` and ``PORT`` in 1..65535 without leading zeros, no path, no user info, no
query. Two endpoints name the same listener (:func:`same_listener`) when their ports
are equal and their hosts are equal or one is ``localhost`` (which may resolve to
either loopback address); the daemon lets one live tenant at a time register it. The daemon never connects to an endpoint
(it only stores and returns it); the rule keeps what a tenant can make its successor
contact to this machine's loopback interface, where the successor can check which
process listens (``kvpool.elastic_server.locate``).

Pure: no I/O. Both sides use it (the daemon at register, clients before sending and
after ``Located``).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from msgspec import Meta

MAX_ENDPOINT = 64  # characters; the longest valid one is 27
Endpoint = Annotated[str, Meta(max_length=MAX_ENDPOINT)]  # bounded on decode; see why_not
_FORM = re.compile(r"http://(\[::1\]|localhost|127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3})"
                   r":([0-9]{1,5})")
RULE = "a loopback http URL: http://127.0.0.1:PORT, http://[::1]:PORT or http://localhost:PORT"


def why_not(endpoint: str) -> str | None:
    """Why ``endpoint`` is not an acceptable tenant endpoint (one line); None when it is."""
    shown = endpoint if len(endpoint) <= MAX_ENDPOINT else endpoint[:MAX_ENDPOINT] + "..."
    m = _FORM.fullmatch(endpoint)
    if m is None:
        return f"endpoint {shown!r} is not {RULE}"
    host, port = m.group(1), int(m.group(2))
    if host.startswith("127."):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return (f"endpoint {shown!r}: {host} is not an IPv4 address in its one "
                    f"spelling (decimal octets 0..255, no leading zeros)")
        if str(ipaddress.IPv4Address(host)) != host:
            return (f"endpoint {shown!r} is not in its one spelling: write the address as "
                    f"{ipaddress.IPv4Address(host)}")
    if m.group(2) != str(port):
        return f"endpoint {shown!r} is not in its one spelling: write the port as {port}"
    if not 1 <= port <= 65535:
        return f"endpoint {shown!r}: port {port} is not in 1..65535"
    return None


def same_listener(a: str, b: str) -> bool:
    """Whether valid endpoints ``a`` and ``b`` may reach the same listener: the same
    port, and the same host or ``localhost`` on either side."""
    ha, pa = a[len("http://"):].rsplit(":", 1)
    hb, pb = b[len("http://"):].rsplit(":", 1)
    return pa == pb and (ha == hb or "localhost" in (ha, hb))


def port_of(endpoint: str) -> int:
    """The port of a valid endpoint (``why_not(endpoint)`` is None)."""
    return int(endpoint.rsplit(":", 1)[1])


def for_listener(host: str, port: int) -> str | None:
    """The endpoint a server bound to ``host``:``port`` is reachable at on loopback, or
    None when it does not listen there (a specific non-loopback address)."""
    if host in ("", "0.0.0.0", "localhost") or host.startswith("127."):
        h = "localhost" if host == "localhost" else (
            host if host.startswith("127.") else "127.0.0.1")
    elif host in ("::", "::1", "[::]", "[::1]"):
        h = "[::1]"
    else:
        return None
    url = f"http://{h}:{port}"
    return url if why_not(url) is None else None
