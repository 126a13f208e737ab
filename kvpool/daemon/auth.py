"""The one place where the daemon decides whether a request is allowed.

Identity comes from the kernel, never from the client: the fd channel's ``SO_PEERCRED``
gives the peer's pid, uid and primary gid at connect time, plus its supplementary groups
from ``/proc/<pid>/status`` (read at accept). The session token issued on that channel
binds every control message to that identity. (ZeroMQ over ipc hides the peer's
credentials, hence the fd channel: every client that needs an identity opens one; the
CLI's admin commands do too.)

Rules:

* who may connect at all is decided by the filesystem: the run directory is 0750 and
  the sockets 0660, both owned by the configured ``socket_group``;
* ``register`` needs the token of a not-yet-registered fd-channel session;
* ``register`` of a name configured with ``uids``/``group`` needs a peer with one of
  those uids or in that group (:func:`may_claim`); a memory-holding session cannot take
  a name another live one holds (the arbiter checks);
* ``ping`` is open to anyone who can connect; the other read-only ops (``ps``,
  ``stats``, ``map``, ``check``) need a registered session of any kind (a monitor
  registers as kind ``monitor``): their replies are bounded, but not free to build;
* ``sleep_tenant`` (``p.SESSION_OPS``) needs a registered session of any kind, sent from
  the identity that registered it; the handler (:mod:`kvpool.daemon.sleepers`) refuses a
  tenant of another uid unless the session is an admin identity (:func:`may_act_on`);
* admin ops (``set_limit``, ``shutdown``) need the token of a session whose peer is an
  *admin identity*: root, the daemon's own uid, or a member of ``admin_group``;
* every other op needs the token of a registered tenant, sent from the ZeroMQ identity
  that registered it (a stolen token used from another connection is refused); the
  arbiter refuses a tenant's access to another tenant's groups (``UNAUTHORIZED``).
"""

from __future__ import annotations

import grp
import os

from kvpool import protocol as p
from kvpool.daemon.config import TenantPolicy
from kvpool.daemon.tenants import TenantRecord, Tenants

READ_ONLY_OPS = frozenset(p.MONITOR_OPS | {"check"})
ANY_SESSION_OPS = frozenset(READ_ONLY_OPS | p.SESSION_OPS)  # registered, any kind


class Denied(Exception):
    """Raised by :func:`authorize`; becomes an ``UNAUTHORIZED`` reply."""


def peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's primary and supplementary groups (``/proc/<pid>/status`` ``Groups:``)."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(x) for x in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass
    return groups


def is_admin(uid: int, groups: set[int], admin_gid: int | None) -> bool:
    """Root, the daemon's own uid, or a member of the admin group."""
    return uid == 0 or uid == os.getuid() or (admin_gid is not None and admin_gid in groups)


def may_claim(name: str, policy: TenantPolicy, uid: int, groups: set[int]) -> str | None:
    """Why a peer (``uid``, ``groups``) may not register as the configured tenant
    ``name`` whose :class:`~kvpool.daemon.config.TenantPolicy` is ``policy``; None when
    it may. A policy naming neither ``uids`` nor ``group`` is bound to the daemon's own
    uid (and root): a configured name carries a policy (a ``min``, ``shares``) the
    operator gave someone, and the first process of any uid to register it must not get
    it (docs/THREAT-MODEL.md, "Tenant names")."""
    uids = list(getattr(policy, "uids", None) or [])
    group = getattr(policy, "group", None)
    if not uids and not group:
        if uid in (0, os.getuid()):
            return None
        return (f"tenant name {name!r} is configured without uids or group, so only the "
                f"daemon's own uid ({os.getuid()}) may register it; uid {uid} is not it "
                f"(the config's [tenants.{name}] uids = [...] admits others)")
    if uid in uids:
        return None
    if group:
        try:
            if grp.getgrnam(group).gr_gid in groups:
                return None
        except KeyError:
            pass
    who = " or ".join(x for x in (f"uid {', '.join(map(str, uids))}" if uids else "",
                                  f"members of group {group}" if group else "") if x)
    return f"tenant name {name!r} is reserved by the daemon's config for {who}; uid {uid} is not one"


def may_act_on(asker: TenantRecord, target: TenantRecord) -> bool:
    """Whether ``asker`` may put ``target`` to sleep or wake it: its own uid, or an
    admin identity."""
    return asker.admin or asker.uid == target.uid


def authorize(op: str, token: str, identity: bytes, tenants: Tenants) -> TenantRecord | None:
    """The tenant a request acts as (None for anonymous monitor requests)."""
    tenant = tenants.by_token.get(token) if token else None
    if op == "register":
        if tenant is None:
            raise Denied("unknown session token (connect the fd channel first)")
        return tenant
    if op == "ping":
        if token and tenant is None:
            raise Denied("unknown session token")
        return tenant
    if op in ANY_SESSION_OPS:  # bounded but not free: only for registered sessions
        if tenant is None:
            raise Denied(f"{op} needs a registered session (connect the fd channel and "
                         f"register, e.g. as kind 'monitor')")
        if not tenant.registered:
            raise Denied("session is not registered yet")
        if tenant.identity != identity:
            raise Denied("session token used from another connection")
        return tenant
    if op in p.ADMIN_OPS:
        if tenant is None:
            raise Denied(f"{op} needs an admin session (open the fd channel)")
        if not tenant.admin:
            raise Denied(f"{op} needs an admin identity (root, the daemon's user or the "
                         f"admin group); uid {tenant.uid} is not one")
        return tenant
    if tenant is None:
        raise Denied("this op needs a valid session token")
    if not tenant.registered:
        raise Denied("session is not registered yet")
    if tenant.identity != identity:
        raise Denied("session token used from another connection")
    return tenant
