"""Pool memory for tensors: one region a process carves torch tensors from, backed by
whole pages the daemon grants as it grows (a trainer's parameters, gradients, optimizer
state and step scratch: :mod:`kvpool.client_lib.trainer`).

An :class:`Arena` is a one-region :class:`~kvpool.client_lib.regions.RegionGroup` of a
large *virtual* capacity (it costs nothing until mapped) and a bump pointer: :meth:`carve`
hands out ``[offset, offset + nbytes)`` and grants the pages under it that are not mapped
yet, so every byte a tensor of the arena uses is a page the daemon counts (``ps``:
``mapped``) and gets back, zeroed for the next tenant, when the process ends or dies.

Tensors the arena *holds* (:meth:`hold`: a tensor whose storage it replaced by a view of
its pages, ``t.data = view``) can move out of the pool and back without their owners
noticing: :meth:`offload` copies each to process memory (pinned host memory on CUDA),
points the tensor there and gives every page back; :meth:`restore` grants the pages
again, copies back and points the tensors at the pool again. The tensor *objects* stay
the same (an optimizer's state dict keeps working), only their storage moves.

Not thread-safe: the owner (:class:`~kvpool.client_lib.trainer.Trainer`) serialises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvpool.client_lib.regions import RegionGroup

if TYPE_CHECKING:
    import torch

ALIGN = 256  # every carved offset is a multiple of this (any dtype, and CUDA's own)


class ArenaSession(Protocol):
    """What an arena needs of its tenant (a :class:`~kvpool.client_lib.tenant.Tenant`):
    a region group of one region, on this session."""

    @property
    def page_size(self) -> int: ...

    def region_group(self, n_regions: int, capacity_bytes: int, label: str = "",
                     chunk_units: int = 1) -> RegionGroup: ...


class Arena:
    """``capacity`` bytes of address space (rounded up to pages), pages granted as carved.
    ``label`` is the group's label (``kvpool map``)."""

    def __init__(self, session: ArenaSession, label: str, capacity: int):
        self.group = session.region_group(1, capacity, label=label)
        self.page_size = self.group.page_size
        self.capacity = self.group.capacity
        self.label = label
        self.top = 0  # bytes carved so far
        #: tensors whose storage is this arena's (or, offloaded, a host copy), by offset
        self.held: list[tuple[torch.Tensor, int]] = []
        self.offloaded = False

    # ---- sizes ------------------------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        """Pool bytes this arena maps now (what ``ps`` counts for it)."""
        return len(self.group.mapped) * self.page_size

    @property
    def footprint(self) -> int:
        """Pool bytes its carved tensors need, mapped or offloaded."""
        return self.pages_for(self.top) * self.page_size

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    # ---- carving ----------------------------------------------------------------------
    def carve(self, nbytes: int) -> int:
        """Room for ``nbytes`` more: its offset. Grants the pages under it that are not
        mapped (the daemon may reclaim from other tenants first; raises ``NoMemory`` /
        ``OverLimit``, carving nothing). ``ValueError`` past the capacity."""
        if nbytes < 0:
            raise ValueError(f"cannot carve {nbytes} bytes")
        if self.offloaded:
            raise ValueError(f"arena {self.label} is offloaded: restore() it first")
        off = -(-self.top // ALIGN) * ALIGN
        end = off + nbytes
        if end > self.capacity:
            raise ValueError(f"arena {self.label}: {nbytes} bytes more do not fit in its "
                             f"{self.capacity} bytes of address space ({self.top} carved)")
        self.map_upto(end)
        self.top = end
        return off

    def map_upto(self, end: int) -> None:
        """Make sure the pages under ``[0, end)`` are mapped (one grant for the missing)."""
        missing = [u for u in range(self.pages_for(end)) if u not in self.group.mapped]
        if missing:
            self.group.grant(missing)
            self.report()

    def view(self, offset: int, shape: tuple[int, ...] | torch.Size,
             dtype: torch.dtype) -> torch.Tensor:
        """A tensor over the arena's memory at ``offset`` (mapped pages only)."""
        return self.group.tensor(0, dtype, tuple(shape), offset)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
              zero: bool = True) -> torch.Tensor:
        """A new tensor in the arena (zeroed unless ``zero=False``: a page the tenant
        released earlier comes back to it as it was)."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        n = int(torch.Size(shape).numel()) * itemsize
        t = self.view(self.carve(max(n, itemsize)), shape, dtype)
        if zero:
            t.zero_()
        return t

    def hold(self, t: torch.Tensor) -> None:
        """Move ``t``'s data into the arena: its storage becomes a view of the arena's
        pages (``t.data = view``; same dtype, shape, values); the arena can offload and
        restore it from then on."""
        v = self.empty(t.shape, t.dtype, zero=False)
        v.copy_(t.detach())
        t.data = v
        self.held.append((t, v.data_ptr() - self.group.ranges[0].base))

    # ---- moving out and back ----------------------------------------------------------
    def offload(self) -> int:
        """Copy every held tensor out of the pool (pinned host memory on CUDA, process
        memory on the host backend), point it there and give every page back; returns the
        pool bytes given back (0 when already offloaded)."""
        if self.offloaded:
            return 0
        cuda = self.group.backend.caps.tensor_device != "cpu"  # device memory
        for t, _ in self.held:
            host = t.data.to("cpu", copy=True)
            t.data = host.pin_memory() if cuda else host
        if cuda:
            import torch

            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # copies done
                torch.cuda.synchronize()
        freed = self.mapped_bytes
        self.group.release(sorted(self.group.mapped), in_use=0, reserve=[])
        self.offloaded = True
        return freed

    def restore(self) -> int:
        """Grant the pages again (may wait, raises ``NoMemory``), copy every held tensor
        back and point it at the pool again; returns the bytes granted."""
        if not self.offloaded:
            return 0
        self.map_upto(self.top)
        for t, off in self.held:
            v = self.view(off, t.shape, t.dtype)
            v.copy_(t.data)
            t.data = v
        self.offloaded = False
        self.report()
        return self.mapped_bytes

    def release_all(self) -> int:
        """Give every page back and forget what was carved (a step's scratch, after the
        step: nothing may still use it); returns the bytes given back."""
        freed = self.mapped_bytes
        self.held.clear()
        self.top = 0
        if self.group.mapped:
            self.group.release(sorted(self.group.mapped), in_use=0, reserve=[])
        return freed

    def report(self, reserve: bool = False) -> None:
        """Tell the daemon the bytes in use (every mapped one) and, with ``reserve``,
        that every mapped unit can be given back without loss (offloaded on request)."""
        units = sorted(self.group.mapped)
        self.group.set_usage(in_use=len(units) * self.page_size,
                             reserve=units if reserve else [])

    def close(self) -> None:
        self.held.clear()
        self.group.close()
