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

It is kept current: rewritten whenever a model's state changes (a member that dies is
``starting`` again, one that cannot start ``failed``) and emptied (``endpoints: []``)
when the fleet stops. Every write is atomic: a temporary file in the same folder,
flushed, renamed over the old one, so a reader sees the old file or the new one, never
half of one. Values are written as JSON strings and numbers, which YAML reads as they are.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
ENGINE_TYPE = "kvpool"
STATE_LABEL = "kvpool.io/state"
FLEET_LABEL = "kvpool.io/fleet"
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class EndpointsFileError(RuntimeError):
    """The file cannot be written (its folder missing or not writable); one line."""


def advertised_address(host: str, given: str | None = None) -> str:
    """Where a router reaches a fleet bound to ``host``: ``given`` when set, the host
    itself when it is one address, else this machine's address by its host name (the
    loopback address when the name does not resolve)."""
    if given:
        return given
    if host not in WILDCARDS:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def dns_name(text: str) -> str:
    """``text`` as a DNS label: lower case, ``[a-z0-9-]``, at most 63 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (name or "endpoint")[:63].rstrip("-") or "endpoint"


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


def render(items: list[dict[str, Any]], header: str = "") -> str:
    """The YAML text of ``items`` (scalars as JSON: YAML reads them as they are)."""
    lines = [f"# {line}" for line in header.splitlines()]
    if not items:
        return "\n".join([*lines, "endpoints: []", ""])
    lines.append("endpoints:")
    for e in items:
        lines.append(f"  - name: {json.dumps(e['name'])}")
        for key in ("namespace", "address", "port"):
            lines.append(f"    {key}: {json.dumps(e[key])}")
        lines.append("    labels:")
        for k, v in e["labels"].items():
            lines.append(f"      {json.dumps(k)}: {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once (temporary file + rename, same folder)."""
    folder = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise EndpointsFileError(f"cannot write the endpoints file {path}: "
                                 f"{e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise EndpointsFileError(f"cannot write the endpoints file {path}: "
                                 f"{e.strerror or e}") from None


class EndpointsFile:
    """The endpoints file of fleet ``fleet`` at ``path``: :meth:`update` with the
    models' states (written when they changed), :meth:`close` empties it."""

    def __init__(self, path: Path, fleet: str, address: str, port: int,
                 namespace: str = "default") -> None:
        self.path = path
        self.fleet, self.address, self.port, self.namespace = fleet, address, port, namespace
        self.header = (f"endpoints of kvpool fleet {fleet!r} (pid {os.getpid()}), kept "
                       f"current by the fleet; replaced atomically")
        self._written: str | None = None

    def update(self, states: Mapping[str, str]) -> bool:
        """Write the entries for ``states`` unless the file already says them; True
        when written."""
        text = render(entries(self.fleet, self.namespace, self.address, self.port, states),
                      self.header)
        if text == self._written:
            return False
        write_atomic(self.path, text)
        self._written = text
        return True

    def close(self) -> None:
        """The fleet stops: no endpoint left (``endpoints: []``)."""
        self.update({})
