"""The bundled engine's parameters in a weight set (docs/ARCHITECTURE.md, "Weight sets"):
one copy in the pool for every engine of the same checkpoint, dtype and layout, used in
place (zero-copy tensors over the set's read-only mapping, as the KV cache is).

Layout (:class:`Layout`): the model's parameters in ``named_parameters()`` order (a tied
embedding is one parameter), each at an offset aligned to :data:`ALIGN` bytes, in the
engine's dtype. The set's key (:func:`set_key`) is the sha256 over the checkpoint's
content key (:func:`kvpool.client_lib.weights.content_key`), the dtype, and the layout
(names, shapes, offsets, :data:`LAYOUT_VERSION`): a bf16 engine never attaches an fp32
set, a different checkpoint or model layout never attaches it.

:class:`PoolWeights` keeps the set's virtual range for its whole life: ``release()``
unmaps and lets go of the pages (the parameters fault when touched), ``restore()`` maps
the set at the same addresses again (attached when the daemon still caches it, else
created, loaded from the checkpoint and sealed), so the model's parameter tensors never
change.

In place (:meth:`PoolWeights.follow`): the engine reads a trainer's *mutable* set of
the same layout (:mod:`kvpool.client_lib.mutable_weights`) instead, at the same
addresses, and moves to each published version by a remap: no byte copied. The set's
key is :func:`mutable_key` of the engine's own layout and the trainer's nonce, so a
trainer whose layout differs names a key the engine never attaches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError
from kvpool.client_lib.mutable_weights import MutableReader
from kvpool.client_lib.tensors import tensor_view
from kvpool.client_lib.weights import WeightSession, WeightSet
from kvpool.engine_adapters.bundled.settings import MEMORY_WAIT_S
from kvpool.vmm import Range

log = logging.getLogger("kvpool.engine_adapters.bundled.weights")

LAYOUT_VERSION = 1  # bump when the way parameters are laid out in a set changes
ALIGN = 256  # bytes: every parameter starts on a multiple (cache lines, SIMD loads)


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the set."""

    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where each parameter of a model lies in its weight set, in ``dtype``."""

    dtype: torch.dtype
    slots: tuple[Slot, ...]
    nbytes: int

    @classmethod
    def of(cls, model: torch.nn.Module, dtype: torch.dtype) -> Layout:
        """The layout of ``model``'s parameters (shapes only: a meta model will do)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        slots, offset = [], 0
        for name, param in model.named_parameters():  # a tied parameter once
            n = param.numel() * itemsize
            slots.append(Slot(name, tuple(param.shape), offset, n))
            offset += -(-n // ALIGN) * ALIGN
        return cls(dtype, tuple(slots), max(offset, 1))

    def digest(self) -> str:
        text = json.dumps([LAYOUT_VERSION, ALIGN, str(self.dtype),
                           [[s.name, list(s.shape), s.offset] for s in self.slots]])
        return hashlib.sha256(text.encode()).hexdigest()


def set_key(checkpoint_key: str, layout: Layout) -> str:
    """The weight set's key: a checkpoint's tensors laid out by ``layout``."""
    h = hashlib.sha256(b"kvpool-engine-weights\0")
    h.update(checkpoint_key.encode() + b"\0" + layout.digest().encode())
    return h.hexdigest()


def mutable_key(layout: Layout, nonce: str) -> str:
    """The key of a trainer's mutable set laid out by ``layout`` (``nonce``: the
    trainer's, so that two trainers never collide)."""
    h = hashlib.sha256(b"kvpool-mutable-weights\0")
    h.update(layout.digest().encode() + b"\0" + nonce.encode())
    return h.hexdigest()


class PoolWeights:
    """The model's parameters as views into one weight set.

    ``load(tensors)`` fills the parameters (name -> a writable tensor of the parameter's
    shape and dtype) from the checkpoint; it runs only when this engine creates the set.
    ``wait_s``: how long :meth:`open` / :meth:`restore` wait for memory (a create the
    pool cannot meet now) and for another tenant loading the same key.
    """

    def __init__(self, session: WeightSession, key: str, layout: Layout,
                 load: Callable[[Mapping[str, torch.Tensor]], None],
                 wait_s: float = MEMORY_WAIT_S) -> None:
        self.session = session
        self.key = key
        self.layout = layout
        self._load_tensors = load
        self.wait_s = wait_s
        self.held = False  #: True between open/restore and release
        self.loads = 0  #: how many times this process loaded the set from the checkpoint
        self._set: WeightSet | None = None
        #: a trainer's mutable set this engine reads (:meth:`follow`) instead of ``key``'s
        self.mutable: str | None = None
        self._reader: MutableReader | None = None
        self._range: Range | None = None  # the set's addresses while released
        self._lock = threading.Lock()

    # ---- holding --------------------------------------------------------------------
    def open(self) -> dict[str, torch.Tensor]:
        """Attach the set, or create, load and seal it; returns the parameters as tensors
        over the set's (read-only) mapping, valid for the life of this object (they
        fault while released). Called once."""
        with self._lock:
            assert self._set is None and self._range is None, "opened already"
            self._set = self._open(None)
            self.held = True
            rng = self._set.range
            assert rng is not None
        backend = self.session.backend
        return {s.name: tensor_view(backend, rng, self.layout.dtype, s.shape, s.offset)
                for s in self.layout.slots}

    def release(self) -> None:
        """Unmap the set's pages and detach (WeightDetach); KEEP the virtual range, so
        the parameter tensors keep their addresses (touching them faults until
        :meth:`restore`). Idempotent."""
        with self._lock:
            self._range = self._let_go() or self._range

    def restore(self) -> bool:
        """Attach the set again into the SAME range (warm: the daemon still caches it);
        when the daemon has no such set any more, create + load it from the checkpoint
        (cold) and seal. Returns True when it was a warm attach (also when held
        already). Waits up to ``wait_s`` for memory; raises KvpoolError with the
        daemon's code when that fails."""
        with self._lock:
            if self.held:
                return True
            assert self._range is not None, "restore before open"
            if self.mutable is not None:
                try:
                    self._reader = MutableReader.attach(self.session, self.mutable,
                                                        self._range)
                    self._range = None
                    self.held = True
                    return True
                except KvpoolError as e:  # its writer and every reader left: gone
                    log.warning("mutable weight set %s is gone (%s): serving %s again",
                                self.mutable[:12], e, self.key[:12])
                    self.mutable = None
            loads = self.loads
            self._set = self._open(self._range)
            self._range = None
            self.held = True
            return self.loads == loads

    def rekey(self, key: str, load: Callable[[Mapping[str, torch.Tensor]], None]) -> bool:
        """Serve another set of the same layout from now on (a new checkpoint): held, the
        current set is detached (the range kept) and ``key``'s attached, or created,
        loaded with ``load`` and sealed, at the SAME addresses, so the parameters never
        change; released (asleep), only remembered (:meth:`restore` opens it). Returns
        True when this call loaded the set (bytes copied), False when it attached one or
        only remembered it. When the new set cannot be opened the old one is opened
        again (warm while the daemon caches it) and the error raised. The caller makes
        sure nothing reads the parameters meanwhile (the engine's ``step_lock``)."""
        with self._lock:
            old_key, old_load = self.key, self._load_tensors
            self.key, self._load_tensors = key, load
            was_mutable, self.mutable = self.mutable, None
            if not self.held:
                return False
            rng = self._let_go()
            assert rng is not None
            loads = self.loads
            try:
                self._set = self._open(rng)
            except BaseException:
                self.key, self._load_tensors = old_key, old_load
                if was_mutable is not None:  # (a gone set raises: nothing serves)
                    self.mutable = was_mutable
                    self._reader = MutableReader.attach(self.session, was_mutable, rng)
                else:
                    self._set = self._open(rng)  # the last complete version again
                self.held = True
                raise
            self.held = True
            return self.loads != loads

    def follow(self, key: str, version: int | None = None) -> int:
        """Read the mutable set ``key`` (a trainer's, of this layout) from now on, at
        ``version`` (None: the current one): the first call detaches the sealed set
        keeping the range and attaches ``key`` into it; later ones remap the range to
        the version's buffer (:meth:`MutableReader.follow`). No byte is copied; the
        parameters never change. Asleep, only remembered (the wake attaches it).
        Returns the version now read (0 asleep). When the daemon refuses, what served
        before serves on and the error is raised. The caller makes sure nothing reads
        the parameters meanwhile (the engine's ``step_lock``)."""
        with self._lock:
            if not self.held:
                self.mutable = key
                return 0
            if self._reader is not None and self.mutable == key:
                if version is not None:
                    self._reader.follow(version)
                return self._reader.version
            rng = self._let_go()
            assert rng is not None
            try:
                reader = MutableReader.attach(self.session, key, rng)
            except BaseException:
                self.held = False
                self._range = rng
                self._reopen_previous(rng)
                raise
            self.mutable, self._reader, self.held = key, reader, True
            if version is not None and version != reader.version:
                reader.follow(version)
            return reader.version

    @property
    def version(self) -> int:
        """The mutable set's version this engine reads (0: none)."""
        return self._reader.version if self._reader is not None else 0

    def close(self) -> None:
        """Let go of the set and free the range (the parameters must not be used
        again). A gone daemon is no error here. Idempotent."""
        with self._lock:
            ws, self._set = self._set, None
            reader, self._reader = self._reader, None
            rng, self._range = self._range, None
            self.held = False
        if ws is not None:
            with contextlib.suppress(KvpoolError, OSError):
                ws.detach()  # unmaps and frees the range before it tells the daemon
        if reader is not None:
            reader.detach()  # (a gone daemon: no error)
        if rng is not None:
            self.session.backend.free_range(rng)

    # ---- inside -----------------------------------------------------------------------
    def _let_go(self) -> Range | None:
        """Detach whatever is held, keeping the range (returned; None: nothing held)."""
        rng: Range | None = None
        if self._set is not None:
            ws, self._set = self._set, None
            rng = ws.detach(keep_range=True)
        elif self._reader is not None:
            reader, self._reader = self._reader, None
            rng = reader.detach(keep_range=True)
        self.held = False
        return rng

    def _reopen_previous(self, rng: Range) -> None:
        """After a failed :meth:`follow`: the mutable set read before, else the sealed
        set, attached into ``rng`` again."""
        if self.mutable is not None:
            self._reader = MutableReader.attach(self.session, self.mutable, rng)
        else:
            self._set = self._open(rng)
        self._range = None
        self.held = True

    def _open(self, rng: Range | None) -> WeightSet:
        deadline = time.monotonic() + self.wait_s
        pause = 0.05
        while True:
            try:
                return WeightSet.open(self.session, self.key, self.layout.nbytes,
                                      wait_s=max(0.0, deadline - time.monotonic()), rng=rng,
                                      load_set=self._load)
            except KvpoolError as e:
                if e.code != p.NO_MEMORY or time.monotonic() >= deadline:
                    raise
                log.info("weight set %s: no memory yet (%s); waiting", self.key[:12], e)
            time.sleep(pause)  # the pool frees memory as others shrink or leave
            pause = min(pause * 2, 1.0)

    def _load(self, ws: WeightSet) -> None:
        assert ws.range is not None
        # a tensor over the writable mapping: host RAM or device memory alike
        buf = tensor_view(self.session.backend, ws.range, torch.uint8, (ws.nbytes,))
        tensors = {s.name: buf[s.offset:s.offset + s.nbytes].view(self.layout.dtype)
                   .view(s.shape) for s in self.layout.slots}
        self._load_tensors(tensors)
        self.loads += 1
