"""Who may use a new server's relay routes (``POST /pd/adopt``, ``GET``/``DELETE
/pd/follow/{id}``, :mod:`.app`): only the server it took over from — the tenant
whose offer it claimed, named by the daemon in the claim's answer (``Claimed.giver``) —
decided from identity as for ``/pd/retire`` (:mod:`.retire_auth`, docs/THREAT-MODEL.md
"Who may ask a server to retire"):

1. this server took a cache over (``--handoff-from``); a server that took nothing over
   has no giver and refuses every relay call (403);
2. this server's tenant asks the daemon where the giver runs (``Locate(giver)``:
   answered only when the giver may hand pages to this tenant — the same uid or
   ``[tenants.GIVER] handoff_to``, the pairing rule), with its pid from ``SO_PEERCRED``;
   a giver that is gone, or no longer paired, is refused (403);
3. the request's TCP connection is a loopback socket open in that pid
   (:func:`.retire_auth.check_connection`; a socket of another uid this server cannot
   see is refused, never guessed).

A refusal is a 403 with one line, before the body is used: nothing is started, looked
up or dropped for a caller that is not the giver.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from kvpool.engine_adapters.bundled.bridge import bridge_of
from kvpool.elastic_server.retire_auth import (Refused, address, check_connection,
                                                        check_local_peer)


class RelayGate(Protocol):
    """What the relay routes ask before they use a request (:func:`.app.add_routes`)."""

    async def refusal(self, request: Any, route: str) -> Any:
        """None to let the request on ``route`` through; else the response that refuses
        it (sent as it is). Must not change the server's state."""


class RelayAuth:
    """The relay routes' check: the caller is tenant ``giver``'s process (``None``: this
    server took nothing over, every caller is refused)."""

    def __init__(self, engine: Any, giver: str | None) -> None:
        self.engine = engine
        self.giver = giver

    async def refusal(self, request: Any, route: str) -> Any:
        """For a relay route: None when the caller is the giver, else the JSON error
        response (403, one line). The daemon call and the /proc scan run off the loop."""
        from fastapi.responses import JSONResponse

        try:
            await asyncio.to_thread(self.check, address(request.client),
                                    address(request.scope.get("server")), route)
        except Refused as e:
            return JSONResponse({"error": {"message": e.line, "type": "invalid_request_error",
                                           "code": "forbidden"}}, e.status)
        return None

    def check(self, peer: tuple[str, int] | None, server: tuple[str, int] | None,
              route: str) -> None:
        """Raise :class:`Refused` (403) unless the connection ``peer`` -> ``server`` is
        open in the giver's process and the giver may still hand pages to this tenant."""
        what = f"{route} refused"
        if self.giver is None:
            raise Refused(403, f"{what}: this server took nothing over, so no server may "
                               f"relay requests to it")
        peer, server = check_local_peer(what, peer, server)
        check_connection(self.giver, self._pid(self.giver, what), peer, server, action=route)

    def _pid(self, giver: str, what: str) -> int:
        from kvpool.client_lib import KvpoolError

        bridge = bridge_of(self.engine)
        tenant = bridge.tenant if bridge is not None else None
        if tenant is None:
            raise Refused(403, f"{what}: this server has no kvpool tenant")
        try:
            return int(tenant.locate(giver).pid)
        except KvpoolError as e:
            raise Refused(403, f"{what}: the server it took over from ({giver!r}) "
                               f"is not located: {e.message}") from None
