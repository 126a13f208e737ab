"""A held lease: bytes a tenant holds against the daemon's budget for memory it uses
through its own allocator (a training job, say), made by :meth:`Tenant.lease`. The
daemon reclaims from other tenants to make room; the lease ends with :meth:`Lease.close`
(or the ``with`` block, or the process)."""

from __future__ import annotations

from typing import Protocol


class LeaseHolder(Protocol):
    """The tenant a lease belongs to (a :class:`~kvpool.client_lib.tenant.Tenant`).

    Obligations: ``closed`` is True once the session ended (the daemon dropped the lease
    with it); ``set_lease(n)`` makes the tenant's lease ``n`` bytes and returns what the
    daemon granted."""

    @property
    def closed(self) -> bool: ...

    def set_lease(self, nbytes: int) -> int: ...


class Lease:
    """A held lease (context manager). ``close()`` gives the memory back."""

    def __init__(self, tenant: LeaseHolder, nbytes: int):
        self.tenant = tenant
        self.nbytes = nbytes

    def close(self) -> None:
        if self.nbytes and not self.tenant.closed:
            self.tenant.set_lease(0)
        self.nbytes = 0

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
