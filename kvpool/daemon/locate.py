"""``locate``: a tenant finds another live tenant by name — its pid and the endpoint it
registered — so that a new engine can take an old one over knowing only its tenant name
(``kvpool serve --elastic --handoff-from TENANT``; docs/PD-HANDOFF.md "Warm restart").

Who may locate whom is the handoff rule, decided from identity the daemon holds
(``SO_PEERCRED`` uids and the names sessions registered), never from the request: the
asker is answered only about a tenant that may hand pages to it
(:func:`~kvpool.daemon.escrow.may_pair` with the located tenant as giver and the asker
as receiver: the same uid, or ``[tenants.LOCATED] handoff_to = ["ASKER"]``); with
``Locate.as_giver`` the other way round (the asker as giver: a retiring server checks
that the tenant asking it to retire is one it may hand its pages to, and where it
runs). Only memory-holding sessions may ask (a monitor's name is claimed by nobody, so a
pairing must not be reachable through one). A name nobody holds and a tenant the asker may not
receive from get the same ``NOT_FOUND`` line.

The endpoint is what the located tenant said at register (loopback http only,
:mod:`kvpool.protocol.endpoint`); the daemon vouches for the pid and the name, not for
what listens there (the asker checks that, ``kvpool.elastic_server.locate``).
Read-only: nothing here changes state.
"""

from __future__ import annotations

from typing import AbstractSet

from kvpool import protocol as p
from kvpool.daemon.escrow import may_pair
from kvpool.daemon.grants import require_holder
from kvpool.daemon.handoff import party
from kvpool.daemon.outcome import Fail, Sender
from kvpool.daemon.tenants import TenantRecord, Tenants


class Locator:
    """Finds in ``tenants`` the ones the asker may pair with (the config's handoff
    ``pairs``: (giver name, receiver name) across uids)."""

    def __init__(self, tenants: Tenants, pairs: AbstractSet[tuple[str, str]]):
        self.tenants = tenants
        self.pairs = pairs

    def locate(self, t: TenantRecord, sender: Sender, r: p.Locate) -> p.Reply:
        require_holder(t, "locate")
        if r.name == t.name:
            raise Fail(p.NOT_FOUND, f"{r.name!r} is this session's own name")
        pairs = self.pairs
        for x in self.tenants.named(r.name):
            giver, receiver = (t, x) if r.as_giver else (x, t)
            if may_pair(party(giver), party(receiver), pairs) is None:
                return p.Located(id=r.id, tenant=x.id, name=x.name, pid=x.pid,
                                 endpoint=x.endpoint, uid=x.uid)
        if r.as_giver:
            raise Fail(p.NOT_FOUND, f"no tenant {r.name!r} that {t.name!r} may hand pages "
                                    f"to (none runs as uid {t.uid}, and the daemon's config "
                                    f"pairs none of that name with it)")
        raise Fail(p.NOT_FOUND, f"no tenant {r.name!r} that may hand pages to {t.name!r} "
                                f"(none runs as uid {t.uid}, and the daemon's config pairs "
                                f"none of that name with it)")
