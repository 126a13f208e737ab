"""Weight sets on the client side: a checkpoint's content key, and a handle on a set of
read-only pages in the pool (docs/ARCHITECTURE.md, "Weight sets").

    key = content_key("model.safetensors").key     # cached beside the checkpoint
    ws = WeightSet.open(tenant, key, nbytes, load=lambda buf: fill(buf))
    w = ws.array("float32", (4096, 4096), offset=0)  # numpy view of the pages, read-only
    ws.detach()

The key is the sha256 over the checkpoint's tensors — for each tensor of each
safetensors file, in file and name order: its name, dtype, shape and bytes; a file of
another format is hashed as its name and bytes — so two checkpoints that differ in one
byte of one tensor never share a key. Hashing reads every byte once; the key is cached
in a file beside the checkpoint (:func:`cache_path`) with each file's size and mtime,
and a second start whose files match reads it from there (a cache that does not match,
or does not parse, is ignored and rewritten). Whoever can write the checkpoint's
directory can write that file too: it could equally change the weights.

A creator maps the pages writable, loads, and :meth:`WeightSet.seal` s: the mapping is
given up first (the kernel refuses a write seal while a writable shared mapping exists),
the daemon seals the pages, and they are mapped back read-only. An attacher maps them
read-only at once. A memoryview or array taken from a set is valid until
:meth:`WeightSet.detach` (touching it afterwards faults, like any unmapped memory).

Keeping the addresses: ``detach(keep_range=True)`` unmaps and lets go of the pages but
hands the reserved virtual range back to the caller, who passes it as ``rng=`` to the
next :meth:`WeightSet.attach` / :meth:`~WeightSet.create` / :meth:`~WeightSet.open` of
the same key: the set is mapped at the same base again, so tensors made over the first
mapping (the engine's parameters) stay valid (they fault while nothing is mapped). The
caller frees a range it keeps with ``backend.free_range`` when done.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kvpool import fdchannel
from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError
from kvpool.vmm import Backend, Page, Range

if TYPE_CHECKING:
    import numpy

CACHE_SUFFIX = ".kvpool-key.json"
CACHE_VERSION = 1
CHUNK = 8 << 20  # bytes hashed per read
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one


# ====================================================================== content keys
@dataclass(frozen=True)
class CheckpointKey:
    """A checkpoint's content key (64 lower-case hex digits), and whether it came from
    the cache file rather than from hashing."""

    key: str
    cached: bool


def checkpoint_files(path: Path) -> list[Path]:
    """The files whose bytes make the key: ``path`` itself, or a directory's
    ``*.safetensors`` (all its regular files when it has none), in name order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    files = sorted(f for f in path.glob("*.safetensors") if f.is_file())
    if not files:
        files = sorted(f for f in path.iterdir()
                       if f.is_file() and not f.name.endswith(CACHE_SUFFIX))
    if not files:
        raise FileNotFoundError(f"no checkpoint files in {path}")
    return files


def cache_path(path: Path) -> Path:
    """Where the key of the checkpoint at ``path`` is cached: ``FILE.kvpool-key.json``
    beside a file, ``DIR/.kvpool-key.json`` in a directory."""
    return path / CACHE_SUFFIX if path.is_dir() else path.with_name(path.name + CACHE_SUFFIX)


def _stamps(path: Path, files: list[Path]) -> dict[str, list[int]]:
    out = {}
    for f in files:
        st = f.stat()
        out[f.name if path.is_dir() else "."] = [st.st_size, st.st_mtime_ns]
    return out


def content_key(path: str | os.PathLike[str], use_cache: bool = True) -> CheckpointKey:
    """The content key of the checkpoint at ``path`` (a file or a directory), read from
    its cache file when the files' sizes and mtimes match it, else hashed (and the
    cache written, when the directory is writable)."""
    path = Path(path)
    files = checkpoint_files(path)
    stamps = _stamps(path, files)
    cache = cache_path(path)
    if use_cache:
        cached = _read_cache(cache, stamps)
        if cached is not None:
            return CheckpointKey(cached, True)
    h = hashlib.sha256(b"kvpool-weights-v1\0")
    for f in files:
        _hash_file(h, f)
    key = h.hexdigest()
    _write_cache(cache, stamps, key)
    return CheckpointKey(key, False)


def _read_cache(cache: Path, stamps: dict[str, list[int]]) -> str | None:
    try:
        data = json.loads(cache.read_text())
        key = data["key"]
        ok = (data.get("version") == CACHE_VERSION and data.get("files") == stamps
              and isinstance(key, str) and len(key) == 64
              and all(c in "0123456789abcdef" for c in key))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return key if ok else None


def _write_cache(cache: Path, stamps: dict[str, list[int]], key: str) -> None:
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": stamps, "key": key}))
        os.replace(tmp, cache)
    except OSError:  # a read-only checkpoint: hash again next time
        tmp.unlink(missing_ok=True)


def _field(h: Any, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def _hash_file(h: Any, f: Path) -> None:
    """Add ``f`` to ``h``: its tensors (safetensors), else its name and bytes."""
    with open(f, "rb") as fh:
        header = _safetensors_header(fh) if f.suffix == ".safetensors" else None
        if header is None:
            _field(h, b"file:" + f.name.encode())
            fh.seek(0)
            _hash_range(h, fh, 0, os.fstat(fh.fileno()).st_size)
            return
        base, tensors = header
        for name in sorted(tensors):
            t = tensors[name]
            start, end = t["data_offsets"]
            _field(h, b"tensor:" + name.encode())
            _field(h, str(t["dtype"]).encode())
            _field(h, json.dumps(list(t["shape"])).encode())
            _hash_range(h, fh, base + start, end - start)


def _safetensors_header(fh: Any) -> tuple[int, dict[str, Any]] | None:
    """(where the data starts, the tensors' entries), or None when it is no
    safetensors file (then it is hashed whole)."""
    raw = fh.read(8)
    if len(raw) != 8:
        return None
    n = struct.unpack("<Q", raw)[0]
    if n > MAX_HEADER:
        return None
    try:
        header = json.loads(fh.read(n))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        for v in tensors.values():
            start, end = v["data_offsets"]
            if not 0 <= start <= end:
                return None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return 8 + n, tensors


def _hash_range(h: Any, fh: Any, start: int, length: int) -> None:
    fh.seek(start)
    h.update(struct.pack("<Q", length))
    while length > 0:
        chunk = fh.read(min(CHUNK, length))
        if not chunk:
            raise ValueError(f"{fh.name}: truncated at {fh.tell()}")
        h.update(chunk)
        length -= len(chunk)


# ====================================================================== the handle
class WeightSession(Protocol):
    """What a :class:`WeightSet` needs of the tenant's session
    (:class:`kvpool.client_lib.Tenant`). ``call`` raises on an error reply and
    returns the descriptors that preceded the reply (the caller takes them over)."""

    @property
    def backend(self) -> Backend: ...
    @property
    def page_size(self) -> int: ...

    def call(self, req: p.Request, expect: Any) -> tuple[Any, list[int]]: ...


class WeightSet:
    """One weight set this session holds: its pages mapped at :attr:`base` in one
    reserved range, writable while ``loading`` (the creator), read-only once
    ``sealed``. Make one with :meth:`create`, :meth:`attach` or :meth:`open`."""

    def __init__(self, session: WeightSession, reply: p.WeightGranted, fds: list[int],
                 rng: Range | None = None):
        self.session = session
        self.backend = session.backend
        self.key = reply.key
        self.nbytes = reply.nbytes
        self.state = reply.state
        ps = session.page_size
        self.npages = reply.nfds
        self.pages: list[Page] = []
        self.range: Range | None = None
        #: the range was the caller's (``rng``): a failure leaves it reserved
        self.callers_range = rng is not None
        try:
            take = self.backend.import_sealable if self.state == "loading" \
                else self.backend.import_owned
            for i, fd in enumerate(fds):
                self.pages.append(take(fd))
                fds[i] = -1
            if rng is not None and rng.size < self.npages * ps:
                raise ValueError(f"the given range ({rng.size} bytes) cannot hold the set's "
                                 f"{self.npages} pages")
            self.range = rng if rng is not None else self.backend.reserve(
                max(1, self.npages) * ps)
            self._map()
        except BaseException:
            fdchannel.close_all([fd for fd in fds if fd >= 0])
            if rng is not None and self.range is rng:  # the caller's range: keep it
                self._unmap_keep()
            else:
                self._unmap_all()
            session.call(p.WeightDetach(key=self.key), p.Done)
            raise

    # ---- making one -----------------------------------------------------------------
    @classmethod
    def create(cls, session: WeightSession, key: str, nbytes: int,
               rng: Range | None = None) -> "WeightSet":
        """A new set of ``nbytes`` for ``key``, loading: write it through :attr:`view`,
        then :meth:`seal`. ``rng``: map it there (a range kept by ``detach``)."""
        reply, fds = session.call(p.WeightCreate(key=key, nbytes=nbytes), p.WeightGranted)
        return cls(session, reply, fds, rng)

    @classmethod
    def attach(cls, session: WeightSession, key: str,
               rng: Range | None = None) -> "WeightSet":
        """The sealed set ``key``, mapped read-only (``NotFound`` when there is none);
        ``rng``: map it there (a range kept by ``detach``)."""
        reply, fds = session.call(p.WeightAttach(key=key), p.WeightGranted)
        return cls(session, reply, fds, rng)

    @classmethod
    def open(cls, session: WeightSession, key: str, nbytes: int,
             load: Callable[[memoryview], None] | None = None, wait_s: float = 600.0,
             rng: Range | None = None,
             load_set: Callable[["WeightSet"], None] | None = None) -> "WeightSet":
        """Attach ``key`` when the pool has it sealed; otherwise create it, ``load`` the
        tensors into its writable view (host memory), or have ``load_set`` fill the
        writable set (any backend: a ``tensor_view`` over its :attr:`range`), and seal
        it. While another tenant of this uid loads the same key, wait (up to
        ``wait_s``) for it to seal, then attach; if it gives up instead, load it here.
        ``rng``: map it there (a range kept by ``detach``; it stays the caller's when
        this fails)."""
        if (load is None) == (load_set is None):
            raise ValueError("give one of load and load_set")
        deadline = time.monotonic() + wait_s
        pause = 0.01
        while True:
            try:
                return cls.attach(session, key, rng)
            except KvpoolError as e:
                if e.code != p.NOT_FOUND:
                    raise
            try:
                ws = cls.create(session, key, nbytes, rng)
            except KvpoolError as e:
                if e.code != p.BUSY or time.monotonic() >= deadline:
                    raise
                time.sleep(pause)  # another tenant is loading it: attach once it seals
                pause = min(pause * 2, 0.5)
                continue
            try:
                if load_set is not None:
                    load_set(ws)
                else:
                    assert load is not None
                    load(ws.view)
                ws.seal()
            except BaseException:
                ws.detach(keep_range=rng is not None)
                raise
            return ws

    # ---- the pages ------------------------------------------------------------------
    @property
    def base(self) -> int:
        assert self.range is not None, "detached"
        return self.range.base

    @property
    def view(self) -> memoryview:
        """The set's ``nbytes`` as bytes (read-only once sealed); host memory only
        (``caps.tensor_device == "cpu"``): device memory is reached through
        ``kvpool.client_lib.tensors.tensor_view`` over :attr:`range`."""
        import ctypes

        if self.backend.caps.tensor_device != "cpu":
            raise ValueError(f"the {self.backend.name} backend's pages are not host "
                             "memory: use tensor_view over the set's range")

        mv = memoryview((ctypes.c_char * self.nbytes).from_address(self.base)).cast("B")
        return mv if self.state == "loading" else mv.toreadonly()

    def array(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> "numpy.ndarray":
        """A numpy view of ``shape`` x ``dtype`` at byte ``offset`` of the set."""
        import numpy as np

        dt = np.dtype(dtype)
        count = 1
        for d in shape:
            count *= d
        if offset < 0 or offset + count * dt.itemsize > self.nbytes:
            raise ValueError(f"{count} x {dt} at {offset} is outside the set's "
                             f"{self.nbytes} bytes")
        return np.frombuffer(self.view, dt, count, offset).reshape(shape)

    # ---- seal / detach ----------------------------------------------------------------
    def seal(self) -> None:
        """Loaded: give up the writable mapping, have the daemon seal the pages, map
        them back read-only. (Views taken while loading are invalid afterwards.) When
        the daemon refuses (another writable mapping of a page exists somewhere), the
        set is dropped (detached) and the error raised: load it again."""
        if self.state != "loading":
            raise ValueError("the weight set is sealed already")
        assert self.range is not None
        self.backend.unmap(self.range, 0, self.npages)
        try:
            self.session.call(p.WeightSeal(key=self.key), p.Done)
        except BaseException:  # some pages may be sealed already: the set is lost
            if self.callers_range:
                self._unmap_keep()  # unmapped already; the range stays the caller's
            else:
                self._unmap_all()
            with contextlib.suppress(KvpoolError):
                self.session.call(p.WeightDetach(key=self.key), p.Done)  # dropped
            raise
        self.state = "sealed"
        self._map()

    def detach(self, keep_range: bool = False) -> Range | None:
        """Unmap the pages and stop holding the set (a loading set is dropped).
        ``keep_range``: the reserved range is not freed but returned (now mapping
        nothing: touching it faults); pass it to the next attach/create to get the
        same addresses back, or free it with ``backend.free_range``."""
        if self.range is None:
            return None
        rng: Range | None = self.range
        if keep_range:
            self._unmap_keep()
        else:
            self._unmap_all()
            rng = None
        self.session.call(p.WeightDetach(key=self.key), p.Done)
        return rng

    def _map(self) -> None:
        assert self.range is not None
        if self.state == "loading":
            self.backend.map_pages(self.range, 0, self.pages)
        else:
            self.backend.map_read_only(self.range, 0, self.pages)

    def _unmap_all(self) -> None:
        if self.range is not None:
            self.backend.free_range(self.range)
            self.range = None
        self._release_pages()

    def _unmap_keep(self) -> None:
        """Unmap every mapped page but keep the range reserved (the caller's now)."""
        rng, self.range = self.range, None
        if rng is not None and rng.mapped:  # _map maps all pages or none
            self.backend.unmap(rng, 0, self.npages)
        self._release_pages()

    def _release_pages(self) -> None:
        for page in self.pages:
            self.backend.release(page)
        self.pages = []
