"""The file-discovery ``endpoints.yaml`` a cluster router reads: its text, its atomic
write, and who wrote it (so a reader need not trust a dead writer's entries).

Written by ``kvpool fleet --endpoints-file`` (:mod:`kvpool.fleet.endpoints_file`: one
entry per model of the fleet) and by ``kvpool daemon --endpoints-file``
(:mod:`kvpool.daemon.endpoints`: one entry per registered server); docs/KUBERNETES.md,
"Endpoints without Kubernetes". Shape::

    # kvpool-writer: {"host": "node-a", "boot_id": "6f1e...", "pid": 4242, "start": 81234}
    # (a free-text line saying what keeps the file current)
    endpoints:
      - name: "chat-fleet-qwen"
        namespace: "default"
        address: "10.0.0.5"
        port: 8080
        labels:
          model: "qwen"
          ...

The first line names the writer: its host name, the host's boot id, its pid and the
pid's start time (clock ticks since boot, ``/proc/PID/stat``), so a pid reused after
the writer died is not taken for it. A writer rewrites the whole file at start (a dead
predecessor's entries go at once) and empties it (``endpoints: []``) at a clean stop; a
writer killed with SIGKILL cannot, so its last entries stay until the next start.
:func:`writer_of` and :meth:`Writer.alive` let a reader on the writer's host tell: the
same host and boot with that pid no longer running that process, or another boot of
that host, means the entries are a dead writer's. A reader on another host cannot
check a pid; it relies on the router's own rule (an endpoint whose ``/metrics`` does
not answer, or answers samples older than the router's staleness bound, gets no
requests) until the next start rewrites the file.

Every write is atomic (a temporary file in the same folder, flushed, renamed over the
old one): a reader sees the old file or the new one, never half of one. Values are
JSON strings and numbers, which YAML reads as they are.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
STATE_LABEL = "kvpool.io/state"
WRITER_TAG = "kvpool-writer: "
WILDCARDS = ("", "0.0.0.0", "::", "[::]")
MAX_HEADER = 4096  # characters of the first line a reader looks at


class EndpointsFileError(RuntimeError):
    """The file cannot be written (its folder missing or not writable); one line."""


def advertised_address(host: str, given: str | None = None) -> str:
    """Where a router reaches a server bound to ``host``: ``given`` when set, the host
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


_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def address_problem(text: str) -> str | None:
    """Why ``text`` is not an address a router can be given (an IPv4 or IPv6 literal or
    a DNS name), or None."""
    import ipaddress

    shown = text if len(text) <= 80 else text[:80] + "..."
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    labels = text.lower().rstrip(".").split(".")
    if len(text) > 253 or not text or not all(_DNS_LABEL.fullmatch(x) for x in labels):
        return f"{shown!r} is not an IP address or a DNS name"
    return None


def namespace_problem(text: str) -> str | None:
    """Why ``text`` is not a namespace (a DNS label: ``[a-z0-9-]``, at most 63), or None."""
    if _DNS_LABEL.fullmatch(text) is None:
        shown = text if len(text) <= 80 else text[:80] + "..."
        return f"{shown!r} is not a namespace (lower-case letters, digits and '-', at most 63)"
    return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), None when there is
    no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the command may hold spaces and parentheses: fields after the last ')'
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Writer:
    """Who wrote a file (see the module)."""

    host: str
    boot_id: str
    pid: int
    start: int

    @classmethod
    def me(cls) -> Writer:
        pid = os.getpid()
        return cls(socket.gethostname(), _boot_id(), pid, _start_ticks(pid) or 0)

    def line(self) -> str:
        return "# " + WRITER_TAG + json.dumps({"host": self.host, "boot_id": self.boot_id,
                                               "pid": self.pid, "start": self.start})

    def alive(self) -> bool | None:
        """True when the writer runs (this host, this boot, its pid with its start
        time), False when it is gone (this host: another boot, or the pid no longer that
        process), None when it cannot be told from here (another host)."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id != _boot_id():
            return False
        return _start_ticks(self.pid) == self.start


def writer_of(text: str) -> Writer | None:
    """The writer named by a file's first line; None when it names none (a file kvpool
    did not write, or a hand-made one)."""
    first = text[:MAX_HEADER].split("\n", 1)[0]
    if not first.startswith("# " + WRITER_TAG):
        return None
    try:
        d = json.loads(first[len("# " + WRITER_TAG):])
        w = Writer(str(d["host"]), str(d["boot_id"]), int(d["pid"]), int(d["start"]))
    except (ValueError, KeyError, TypeError):
        return None
    return w


def render(items: list[dict[str, Any]], header: str = "",
           writer: Writer | None = None) -> str:
    """The YAML text of ``items`` (scalars as JSON: YAML reads them as they are), its
    first line naming ``writer`` when given."""
    lines = [writer.line()] if writer is not None else []
    lines += [f"# {line}" for line in header.splitlines()]
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
