"""What a backend can do, as facts its callers branch on instead of its name.

Every :class:`~kvpool.vmm.base.Backend` class carries one :class:`Capabilities` record
(``Backend.caps``); the registry (:mod:`kvpool.vmm.registry`) lists each backend's record
without opening it, so configuration checks can ask before a device exists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Capabilities:
    """Facts about a backend's pages and memory.

    ``handles_are_fds``: a page's handle *is* a file descriptor of its memory (host
    memfds). An exported descriptor names the page itself, so a receiver keeps it as the
    handle (no re-import), two descriptors can be compared for "same page", and a process
    that only maps a page cannot be asked for a new handle (callers keep handles).
    When False (CUDA), a handle is a driver allocation handle: export makes a new fd and
    an import makes a new handle, so page identity cannot be read off a descriptor.

    ``fresh_pages_zeroed``: a newly created page reads zeros (a fresh memfd). When False
    the creator must :meth:`~kvpool.vmm.base.Backend.zero` it before anyone maps it.

    ``device_memory_bounded``: the pages live in memory of their own that others outside
    the pool also use (a GPU's), so :meth:`~kvpool.vmm.base.Backend.mem_info`'s free bytes
    must cover a lease too, not only the pool's budget.

    ``tensor_device``: where a mapped range lives for a tensor library (DLPack's
    device type): ``"cpu"`` (host RAM) or ``"cuda"`` (memory of device ``Backend.device``).

    ``huge_pages``: pages can be backed by hugetlb memory (``huge_pages = true``).

    ``devices_share_memory``: every device ordinal of the backend draws on the same
    memory (host RAM: ``--devices N`` simulates N devices in it), so a daemon serving N
    of them gives each an equal share of what :meth:`~kvpool.vmm.base.Backend.mem_info`
    reports (budgets are checked, and percentages resolved, against that share).

    ``read_only_maps``: pages can be created for a weight set
    (:meth:`~kvpool.vmm.base.Backend.create_sealable_page`) and mapped read-only
    (:meth:`~kvpool.vmm.base.Backend.map_read_only`), a write through such a mapping
    faults, and :meth:`~kvpool.vmm.base.Backend.seal_read_only` exists; but the read-only
    mapping may be the mapping process's own choice. Enough for weight sets shared
    within one uid (docs/ARCHITECTURE.md, "Weight sets": processes of one uid can write
    each other's memory anyway). Host and CUDA (``cuMemSetAccess`` read-only flags).

    ``read_only_shares``: besides, :meth:`~kvpool.vmm.base.Backend.seal_read_only` makes
    a page read-only *for good*, for every holder, whatever it maps (a seal): what a
    set shared across uids (an admin's, visible to every uid) needs. Host: memfd write
    seals. Not CUDA: a process holding a page's exported handle can map it writable.
    Implies ``read_only_maps``.
    """

    handles_are_fds: bool
    fresh_pages_zeroed: bool
    device_memory_bounded: bool
    tensor_device: Literal["cpu", "cuda"]
    huge_pages: bool
    read_only_maps: bool = False
    read_only_shares: bool = False
    devices_share_memory: bool = False

    def __post_init__(self) -> None:
        if self.read_only_shares and not self.read_only_maps:
            raise ValueError("read_only_shares implies read_only_maps")


#: memfd pages in RAM (:mod:`kvpool.vmm.host`)
HOST_CAPS = Capabilities(handles_are_fds=True, fresh_pages_zeroed=True,
                         device_memory_bounded=False, tensor_device="cpu", huge_pages=True,
                         read_only_maps=True, read_only_shares=True, devices_share_memory=True)
#: CUDA VMM allocations on a GPU (:mod:`kvpool.vmm.cuda`)
CUDA_CAPS = Capabilities(handles_are_fds=False, fresh_pages_zeroed=False,
                         device_memory_bounded=True, tensor_device="cuda", huge_pages=False,
                         read_only_maps=True)
