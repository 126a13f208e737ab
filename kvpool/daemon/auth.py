"""The one place where the daemon decides whether a request is allowed.

Today's rule (admin identities come in a later issue):

* ``register`` needs the token of a not-yet-registered fd-channel session;
* monitor ops (``ps``, ``stats``, ``map``, ``ping``) are open to anyone who can connect
  to the control socket (its mode 0660 and group decide who can);
* admin ops (``set_limit``, ``check``) likewise — to be restricted to admin identities;
* every other op needs the token of a registered tenant, sent from the ZeroMQ identity
  that registered it (a stolen token used from another connection is refused).
"""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.daemon.tenants import Tenant, Tenants


class Denied(Exception):
    """Raised by :func:`authorize`; becomes an ``UNAUTHORIZED`` reply."""


def authorize(op: str, token: str, identity: bytes, tenants: Tenants) -> Tenant | None:
    """The tenant a request acts as (None for anonymous monitor/admin requests)."""
    tenant = tenants.by_token.get(token) if token else None
    if op == "register":
        if tenant is None:
            raise Denied("unknown session token (connect the fd channel first)")
        return tenant
    if op in p.MONITOR_OPS or op in p.ADMIN_OPS:
        if token and tenant is None:
            raise Denied("unknown session token")
        return tenant
    if tenant is None:
        raise Denied("this op needs a valid session token")
    if not tenant.registered:
        raise Denied("session is not registered yet")
    if tenant.identity != identity:
        raise Denied("session token used from another connection")
    return tenant
