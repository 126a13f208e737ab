"""The fleet's endpoints file: file discovery for a cluster router with no Kubernetes
(``kvpool fleet --endpoints-file PATH``; docs/KUBERNETES.md, "Endpoints without
Kubernetes").

One entry per model of the fleet, all on the fleet's one port (a router's pool for a
model selects its entries by the ``model`` label; the fleet routes by the body's
``model`` among that model's replicas)::

    endpoints:
      - name: "chat-fleet-qwen"          # the fleet's name and the model's, DNS-safe
        namespace: "default"
        address: "10.0.0.5"              # where a router reaches the fleet
        port: 8080
        labels:
          model: "qwen"
          llm-d.ai/engine-type: "kvpool" # the router's engine type (deploy/router/)
          kvpool.io/fleet: "chat-fleet"
          kvpool.io/state: "awake"       # the model's state, as GET /v1/models says

It is kept current: written at once when the fleet starts (so a killed predecessor's
entries go), rewritten whenever a model's state changes (a member that dies is
``starting`` again, one that cannot start ``failed``) and emptied (``endpoints: []``)
when the fleet stops. Text, atomic writes and the first line naming the writer (pid,
boot id: whose entries a reader may trust after a SIGKILL) are :mod:`kvpool.discovery`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpool.discovery import (
    ENGINE_TYPE_LABEL,
    STATE_LABEL,
    EndpointsFileError,
    Writer,
    advertised_address,
    dns_name,
    render,
    write_atomic,
)

ENGINE_TYPE = "kvpool"
FLEET_LABEL = "kvpool.io/fleet"


def entries(fleet: str, namespace: str, address: str, port: int,
            states: Mapping[str, str]) -> list[dict[str, Any]]:
    """The file's entries for the models of ``states`` (model -> its state), in order."""
    out: list[dict[str, Any]] = []
    taken: set[str] = set()
    for model, state in states.items():
        name = base = dns_name(f"{fleet}-{model}")
        n = 2
        while name in taken:
            name = f"{base[:60]}-{n}"
            n += 1
        taken.add(name)
        out.append({"name": name, "namespace": namespace, "address": address, "port": port,
                    "labels": {"model": model, ENGINE_TYPE_LABEL: ENGINE_TYPE,
                               FLEET_LABEL: fleet, STATE_LABEL: state}})
    return out


class EndpointsFile:
    """The endpoints file of fleet ``fleet`` at ``path``: :meth:`update` with the
    models' states (written when they changed), :meth:`close` empties it."""

    def __init__(self, path: Path, fleet: str, address: str, port: int,
                 namespace: str = "default") -> None:
        self.path = path
        self.fleet, self.address, self.port, self.namespace = fleet, address, port, namespace
        self.writer = Writer.me()
        self.header = (f"endpoints of kvpool fleet {fleet!r}, kept current by the fleet; "
                       f"replaced atomically")
        self._written: str | None = None

    def update(self, states: Mapping[str, str]) -> bool:
        """Write the entries for ``states`` unless the file already says them; True
        when written."""
        text = render(entries(self.fleet, self.namespace, self.address, self.port, states),
                      self.header, self.writer)
        if text == self._written:
            return False
        write_atomic(self.path, text)
        self._written = text
        return True

    def close(self) -> None:
        """The fleet stops: no endpoint left (``endpoints: []``)."""
        self.update({})


__all__ = ["ENGINE_TYPE", "ENGINE_TYPE_LABEL", "FLEET_LABEL", "STATE_LABEL", "EndpointsFile",
           "EndpointsFileError", "advertised_address", "dns_name", "entries", "render"]
