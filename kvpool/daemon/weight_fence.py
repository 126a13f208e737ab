"""The version fence of a mutable weight set: one writer, read-only readers, and no
reader ever on a buffer being written (docs/ARCHITECTURE.md, "Mutable weight sets").

A mutable set (``WeightCreate`` with ``mutable``) has two buffers of the same layout, its
pages buffer 0's then buffer 1's. Its creator is its one *writer*: it maps both buffers
writable while the set loads, fills both, and ``WeightSeal`` s it; the daemon then seals
the pages against any *later* writable mapping (host: ``F_SEAL_FUTURE_WRITE``; the
writer's own mappings stay writable) and publishes buffer 0 as version 1. Version ``v``
lives in buffer :func:`buffer_of` ``(v)``; the other one is the *back* buffer.

* ``WeightWrite`` (the writer alone: anyone else is ``UNAUTHORIZED``) opens the back
  buffer for writing, refused ``BUSY`` while any reader still reads it (a reader that
  has not switched to the current version);
* ``WeightPublish`` (after a write) makes the back buffer the current version;
* ``WeightUse`` (a reader, after it remapped its range to the current version's buffer)
  says it reads that version only from now on; any other version is refused.

A reader therefore lags at most one version, and the writer never writes what a reader
reads. A reader attaches at the current version (``WeightAttach``). The writer's death
or detach ends its write: a half-written back buffer is never published, the readers
keep the last complete version, and nobody can write the set again. A mutable set is
never cached: when its last holder lets go it is dropped, its pages retired (never
handed on: sealed pages cannot be zeroed in place) and fresh ones made for the next
tenant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.daemon.outcome import Fail

BUFFERS = 2


def buffer_of(version: int) -> int:
    """The buffer version ``version`` (1, 2, ...) lives in."""
    return (version - 1) % BUFFERS


@dataclass
class Fence:
    """A mutable set's writer (tenant id, None once it let go), its current
    ``version`` (0: not sealed yet), whether the back buffer is open for writing, and
    the version each reader (tenant id) reads."""

    writer: int | None
    version: int = 0
    writing: bool = False
    readers: dict[int, int] = field(default_factory=dict)

    @property
    def back(self) -> int:
        """The buffer a write goes to: the one the current version is not in."""
        return self.version % BUFFERS

    def sealed(self) -> None:
        """The writer loaded both buffers: buffer 0 is version 1."""
        self.version = 1

    def begin_write(self, tenant: int) -> p.WeightVersion:
        self._writer_only(tenant, "write")
        if self.version == 0:
            raise Fail(p.BAD_REQUEST, "seal the mutable weight set before writing it")
        on_back = sorted(r for r, v in self.readers.items() if buffer_of(v) == self.back)
        if on_back:
            raise Fail(p.BUSY, f"tenant(s) {on_back[:8]} still read version "
                               f"{self.version - 1} in buffer {self.back}: write it once "
                               f"they use version {self.version}")
        self.writing = True
        return p.WeightVersion(version=self.version, buffer=self.back)

    def publish(self, tenant: int) -> p.WeightVersion:
        self._writer_only(tenant, "publish")
        if not self.writing:
            raise Fail(p.BAD_REQUEST, "nothing is being written: weight_write first")
        self.writing = False
        self.version += 1
        return p.WeightVersion(version=self.version, buffer=buffer_of(self.version))

    def use(self, tenant: int, version: int) -> p.WeightVersion:
        if tenant not in self.readers:
            raise Fail(p.BAD_REQUEST, "only a reader of the set switches versions")
        if version != self.version:
            raise Fail(p.BAD_REQUEST, f"version {version} is not the current one "
                                      f"({self.version})")
        self.readers[tenant] = version
        return p.WeightVersion(version=version, buffer=buffer_of(version))

    def attached(self, tenant: int) -> None:
        self.readers[tenant] = self.version

    def let_go(self, tenant: int) -> None:
        """``tenant`` holds the set no more: a reader reads nothing; the writer's
        write ends unpublished and the set has no writer from now on."""
        self.readers.pop(tenant, None)
        if tenant == self.writer:
            self.writer = None
            self.writing = False

    def _writer_only(self, tenant: int, op: str) -> None:
        if tenant != self.writer:
            raise Fail(p.UNAUTHORIZED, f"only the writer of a mutable weight set may "
                                       f"{op} it")

    def check(self, holders: set[int]) -> list[str]:
        """Readers and writer hold the set; readers lag at most one version; none reads
        the buffer being written."""
        problems = []
        if self.writer is not None and self.writer not in holders:
            problems.append(f"writer {self.writer} does not hold the set")
        for r, v in self.readers.items():
            if r not in holders:
                problems.append(f"reader {r} does not hold the set")
            if not self.version - 1 <= v <= self.version or v < 1:
                problems.append(f"reader {r} reads version {v}, current {self.version}")
            if self.writing and buffer_of(v) == self.back:
                problems.append(f"reader {r} reads buffer {self.back} while it is written")
        return problems
