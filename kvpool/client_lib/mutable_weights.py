"""Mutable weight sets on the client side: the writer's handle and a reader's
(docs/ARCHITECTURE.md, "Mutable weight sets"; the fence: :mod:`kvpool.daemon.weight_fence`).

    w = MutableWriter.create(trainer_tenant, key, nbytes)   # both buffers mapped writable
    fill(w.base(0)); fill(w.base(1)); w.seal()             # version 1 = buffer 0
    b = w.begin_write()      # the back buffer (refused BUSY while a reader still reads it)
    update(w.base(b)); v = w.publish()

    r = MutableReader.attach(engine_tenant, key, rng)     # the current version, read-only
    r.follow(v)              # remap the same addresses to version v's buffer, then tell

The writer maps both buffers once, writable, and keeps them (on the host backend the
daemon's seal lets no later writable mapping exist: a reader's descriptors can only be
mapped read-only). A reader maps one buffer's pages into its range (``nbytes``: one
buffer) and moves it to another buffer at the same addresses: tensors over the range stay
valid, no byte is copied. ``follow`` remaps first and tells the daemon after
(``WeightUse``), so the daemon never counts a reader off a buffer it still maps.
"""

from __future__ import annotations

import contextlib
from kvpool import fdchannel
from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError
from kvpool.client_lib.weights import WeightSession
from kvpool.vmm import Page, Range

BUFFERS = 2


def buffer_of(version: int) -> int:
    """The buffer version ``version`` lives in (kvpool.daemon.weight_fence)."""
    return (version - 1) % BUFFERS


class _Handle:
    """The pages of a mutable set this session holds (both buffers' handles)."""

    def __init__(self, session: WeightSession, reply: p.WeightGranted, fds: list[int],
                 writable: bool):
        self.session = session
        self.backend = session.backend
        self.key = reply.key
        self.nbytes = reply.nbytes
        self.version = reply.version
        self.npages = reply.nfds // BUFFERS  # per buffer
        self.pages: list[Page] = []
        try:
            if reply.nfds != len(fds) or reply.nfds % BUFFERS or not self.npages:
                raise ValueError(f"a mutable set came with {len(fds)} descriptors")
            take = self.backend.import_sealable if writable else self.backend.import_owned
            for i, fd in enumerate(fds):
                self.pages.append(take(fd))
                fds[i] = -1
        except BaseException:
            fdchannel.close_all([fd for fd in fds if fd >= 0])
            self._release_pages()
            with contextlib.suppress(KvpoolError):
                session.call(p.WeightDetach(key=self.key), p.Done)
            raise

    def buffer_pages(self, b: int) -> list[Page]:
        return self.pages[b * self.npages:(b + 1) * self.npages]

    def _release_pages(self) -> None:
        for page in self.pages:
            self.backend.release(page)
        self.pages = []

    def _detach(self) -> None:
        self._release_pages()
        self.session.call(p.WeightDetach(key=self.key), p.Done)


class MutableWriter(_Handle):
    """The one writer of a mutable set: both buffers mapped writable in one range
    (buffer ``b`` at :meth:`base` ``(b)``) for the writer's whole life."""

    def __init__(self, session: WeightSession, reply: p.WeightGranted, fds: list[int]):
        super().__init__(session, reply, fds, writable=True)
        self.writing: int | None = None
        ps = session.page_size
        try:
            self.range: Range | None = self.backend.reserve(BUFFERS * self.npages * ps)
            self.backend.map_pages(self.range, 0, self.pages)
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, session: WeightSession, key: str, nbytes: int) -> "MutableWriter":
        """A new mutable set of two buffers of ``nbytes`` each: fill both, then
        :meth:`seal`."""
        reply, fds = session.call(p.WeightCreate(key=key, nbytes=nbytes, mutable=True),
                                  p.WeightGranted)
        return cls(session, reply, fds)

    def base(self, b: int) -> int:
        """The address of buffer ``b`` in this process."""
        assert self.range is not None, "closed"
        return self.range.base + b * self.npages * self.session.page_size

    def buffer_range(self) -> Range:
        assert self.range is not None, "closed"
        return self.range

    def seal(self) -> int:
        """Both buffers are loaded: the set becomes attachable, buffer 0 its version 1."""
        self.session.call(p.WeightSeal(key=self.key), p.Done)
        self.version = 1
        return self.version

    def begin_write(self) -> int:
        """Open the back buffer for writing; returns its index. ``Busy`` while a reader
        still reads it."""
        reply, _ = self.session.call(p.WeightWrite(key=self.key), p.WeightVersion)
        self.writing = int(reply.buffer)
        return self.writing

    def publish(self) -> int:
        """The back buffer is written whole: it is the current version now (returned)."""
        reply, _ = self.session.call(p.WeightPublish(key=self.key), p.WeightVersion)
        self.writing = None
        self.version = int(reply.version)
        return self.version

    def close(self) -> None:
        """Unmap both buffers and let go (the readers keep the last published version;
        nobody writes the set again). A gone daemon is no error here."""
        if self.range is not None:
            self.backend.free_range(self.range)
            self.range = None
        with contextlib.suppress(KvpoolError, OSError):
            self._detach()


class MutableReader(_Handle):
    """A reader of a mutable set: the current version's buffer mapped read-only in
    ``range`` (``nbytes`` of one buffer). Made by :meth:`attach`."""

    def __init__(self, session: WeightSession, reply: p.WeightGranted, fds: list[int],
                 rng: Range | None):
        super().__init__(session, reply, fds, writable=False)
        ps = session.page_size
        self.callers_range = rng is not None
        try:
            if rng is not None and rng.size < self.npages * ps:
                raise ValueError(f"the given range ({rng.size} bytes) cannot hold a "
                                 f"buffer's {self.npages} pages")
            self.range: Range | None = rng if rng is not None else \
                self.backend.reserve(self.npages * ps)
            self.backend.map_read_only(self.range, 0, self.buffer_pages(buffer_of(self.version)))
        except BaseException:
            self._give_up(keep_range=self.callers_range)
            raise

    @classmethod
    def attach(cls, session: WeightSession, key: str,
               rng: Range | None = None) -> "MutableReader":
        """The mutable set ``key`` at its current version, mapped read-only (in ``rng``
        when given: a range kept by a detach, so tensors over it stay valid)."""
        reply, fds = session.call(p.WeightAttach(key=key), p.WeightGranted)
        if reply.state != "mutable":
            fdchannel.close_all(fds)
            with contextlib.suppress(KvpoolError):
                session.call(p.WeightDetach(key=key), p.Done)
            raise ValueError(f"weight set {key[:12]} is not mutable")
        return cls(session, reply, fds, rng)

    def follow(self, version: int) -> bool:
        """Read ``version`` (the current one) from now on: the range remapped to its
        buffer, then the daemon told. False when this reads it already. When the
        daemon refuses, the old version is mapped back and the error raised. The caller
        makes sure nothing reads the range meanwhile."""
        if version == self.version:
            return False
        assert self.range is not None, "detached"
        old = self.version
        self._remap(buffer_of(version))
        try:
            self.session.call(p.WeightUse(key=self.key, version=version), p.WeightVersion)
        except BaseException:
            self._remap(buffer_of(old))
            raise
        self.version = version
        return True

    def _remap(self, b: int) -> None:
        assert self.range is not None
        self.backend.unmap(self.range, 0, self.npages)
        self.backend.map_read_only(self.range, 0, self.buffer_pages(b))

    def detach(self, keep_range: bool = False) -> Range | None:
        """Unmap and let go; ``keep_range``: the range is returned (mapping nothing)."""
        rng = self.range if keep_range else None
        self._give_up(keep_range)
        return rng

    def _give_up(self, keep_range: bool) -> None:
        rng, self.range = self.range, None
        if rng is not None:
            if keep_range:
                if rng.mapped:
                    self.backend.unmap(rng, 0, self.npages)
            else:
                self.backend.free_range(rng)
        with contextlib.suppress(KvpoolError, OSError):
            self._detach()
