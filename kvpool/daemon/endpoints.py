"""The daemon's endpoints file: one entry per server registered with it, for a cluster
router's file discovery (``kvpool daemon --endpoints-file PATH --endpoints-address A``;
docs/KUBERNETES.md, "Endpoints without Kubernetes").

An entry is a live, registered ``engine`` session that said where it serves
(``Register.endpoint``: a loopback URL, checked at register, one live tenant per
listener) — ``kvpool serve`` and vLLM with the kvpool plugin both do::

    - name: "qwen-8000"                  # the tenant's name and port, DNS-safe
      namespace: "default"
      address: "10.0.0.5"                # the operator's --endpoints-address
      port: 8000                         # the port of its registered endpoint
      labels:
        model: "qwen"                    # the tenant's name (the served model name)
        llm-d.ai/engine-type: "vllm"     # Register.engine, when it said one
        kvpool.io/state: "awake"         # or "asleep"
        kvpool.io/group: "chat"          # Register.group, when it said one

What comes from the tenant is what the daemon already checked and keeps: its name
(``Name``'s characters), its endpoint (loopback URL, so only a port is taken from it),
its engine type (one of ``EngineType``), its group. The address routers reach the
servers at is never a tenant's word: it is the operator's (``--endpoints-address``,
by default this machine's address by its host name). A tenant can only make the file
point at a port of this host it registered, which the daemon lets no other live tenant
register; it cannot name another host.

Kept current from the event loop: a register, a state report, a sleep ask, a goodbye or
a session's end (a server killed with SIGKILL: its fd channel closes, the daemon drops
it) marks the file stale; the loop's timer pass renders the entries and, when the text
changed, hands it to one writer thread (the loop never waits on the disk; a newer text
replaces one not yet written). At start the file is written at once, empty (a dead
daemon's entries go; a path that cannot be written is a one-line start-up error); at a
clean stop it is emptied. The text, the atomic write and the first line naming the
writer (whose entries a reader may trust after a SIGKILL) are :mod:`kvpool.discovery`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvpool.discovery import (
    ENGINE_TYPE_LABEL,
    STATE_LABEL,
    EndpointsFileError,
    Writer,
    dns_name,
    render,
    write_atomic,
)
from kvpool.protocol import endpoint as ep

from kvpool.daemon.tenants import TenantRecord

log = logging.getLogger("kvpool.daemon.endpoints")

GROUP_LABEL = "kvpool.io/group"


def entries(tenants: Iterable[TenantRecord], asleep: Callable[[TenantRecord], bool],
            address: str, namespace: str) -> list[dict[str, Any]]:
    """The file's entries for the registered engine sessions of ``tenants`` that said
    where they serve, by port."""
    out: list[dict[str, Any]] = []
    for t in tenants:
        if not (t.registered and t.kind == "engine" and t.endpoint) or \
                ep.why_not(t.endpoint) is not None:
            continue
        port = ep.port_of(t.endpoint)
        labels: dict[str, str] = {"model": t.name}
        if t.engine:
            labels[ENGINE_TYPE_LABEL] = t.engine
        labels[STATE_LABEL] = "asleep" if asleep(t) else "awake"
        if t.group:
            labels[GROUP_LABEL] = t.group
        out.append({"name": dns_name(f"{t.name}-{port}"), "namespace": namespace,
                    "address": address, "port": port, "labels": labels})
    out.sort(key=lambda e: (e["port"], e["name"]))
    return out


class EndpointsKeeper:
    """The file at ``path`` (see the module). :meth:`start` writes it empty at once
    (raises EndpointsFileError); :meth:`update` from the loop; :meth:`close` empties it
    and ends the writer."""

    def __init__(self, path: Path, address: str, namespace: str) -> None:
        self.path, self.address, self.namespace = path, address, namespace
        self.writer = Writer.me()
        self.header = ("endpoints of the kvpool daemon's servers, kept current by the "
                       "daemon; replaced atomically")
        self.writes = 0
        self.failures = 0
        self._handed = ""  # the last text handed to the writer (or written at start)
        self._pending: str | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._said: str | None = None  # the last failure logged

    def start(self) -> None:
        self._handed = self._text([])
        self._write(self._handed)
        self._thread = threading.Thread(target=self._run, name="kvpool-endpoints",
                                        daemon=True)
        self._thread.start()

    def _text(self, items: list[dict[str, Any]]) -> str:
        return render(items, self.header, self.writer)

    def _write(self, text: str) -> None:
        write_atomic(self.path, text)
        self.writes += 1

    def update(self, tenants: Iterable[TenantRecord],
               asleep: Callable[[TenantRecord], bool]) -> bool:
        """(event loop) Render the entries; hand the text to the writer when it changed.
        True when handed over."""
        text = self._text(entries(tenants, asleep, self.address, self.namespace))
        with self._cond:
            if text == self._handed:
                return False
            self._pending = self._handed = text
            self._cond.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                text, self._pending = self._pending, None
            assert text is not None
            try:
                self._write(text)
                self._said = None
            except EndpointsFileError as e:  # the next change tries again
                self.failures += 1
                if str(e) != self._said:
                    self._said = str(e)
                    log.warning("%s", e)

    def close(self) -> None:
        """The daemon stops: the writer ends and the file says no endpoint."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self._write(self._text([]))
        except EndpointsFileError as e:
            log.warning("%s", e)
