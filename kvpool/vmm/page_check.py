"""What a descriptor must be before the host backend imports it as a page (a trust
boundary: the daemon imports what tenants send on adoption, tenants what the daemon
sends on a grant or claim).

A page is a regular file where memfds live, sealed with :data:`REQUIRED_SEALS` (its size
fixed for good, the seals themselves sealed: nobody can truncate it under another
process's mapping, which would be SIGBUS), of exactly the page size.

"Where memfds live" is decided once per filesystem (``st_dev``): the first descriptor
of a device is judged by its ``/proc/self/fd`` name (``/memfd:``) and a device so proven
is remembered by the :class:`PageCheck`. memfds share their kernel-internal mounts (one
for shmem, one per huge page size) only with files the kernel makes for itself (SysV
shared memory, shared anonymous mappings), whose seals are ``F_SEAL_SEAL`` alone, so the
seal check still refuses those; any tmpfs or hugetlbfs mount is another device, judged
anew. Every descriptor costs one ``fstat`` and one ``F_GET_SEALS``, never a path lookup
after the first of its device.
"""

from __future__ import annotations

import fcntl
import os
import stat

from kvpool.vmm.base import InvalidArgument

# Seals every page carries: its size is fixed for good, and no one can add or drop seals.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# A weight page while it is loaded: its size fixed, its seals still open (the daemon
# adds SEALED_READ_ONLY when the set is sealed).
SEALABLE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# What sealing a weight page adds: no write, now or by a later mapping, and no more seals.
F_SEAL_FUTURE_WRITE = 0x0010
SEALED_READ_ONLY = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


def target(fd: int) -> str:
    """What ``/proc/self/fd/<fd>`` names (``?`` when it cannot be read)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


class PageCheck:
    """Checks descriptors for pages of ``page_size`` bytes; remembers memfd devices."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.memfd_devs: set[int] = set()  # st_dev of filesystems proven to hold memfds

    def check(self, fd: int, required: int = REQUIRED_SEALS) -> None:
        """Raise :class:`InvalidArgument` unless ``fd`` is a page (see the module)
        carrying the seals ``required``."""
        try:
            st = os.fstat(fd)
        except (OSError, TypeError) as e:
            raise InvalidArgument("import", f"fd {fd!r} is not an open descriptor: {e}") from e
        if not stat.S_ISREG(st.st_mode) or not self.on_memfd_fs(fd, st.st_dev):
            raise InvalidArgument("import", f"fd {fd} is not a memfd page ({target(fd)})")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise InvalidArgument("import", f"fd {fd}: cannot read its seals: {e}") from e
        if seals & required != required:
            raise InvalidArgument(
                "import", f"fd {fd} lacks seals {required & ~seals:#x} (has {seals:#x}): "
                "a holder could resize it under the other mappings"
            )
        if st.st_size != self.page_size:
            raise InvalidArgument(
                "import", f"fd {fd} holds {st.st_size} bytes, expected page size {self.page_size}"
            )

    def on_memfd_fs(self, fd: int, dev: int) -> bool:
        """Whether ``fd`` (on device ``dev``) lives where memfds do."""
        if dev in self.memfd_devs:
            return True
        if not target(fd).startswith("/memfd:"):
            return False
        self.memfd_devs.add(dev)
        return True
