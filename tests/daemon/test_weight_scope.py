"""Who may attach a weight set, by backend capability (docs/ARCHITECTURE.md, "Weight
sets"): an admin's set is visible to every uid only where sealing makes pages read-only
for good (``caps.read_only_shares``: host); on a backend whose pages can only be
*mapped* read-only (``caps.read_only_maps`` alone: CUDA) it is scoped to the admin's
uid like anyone's, since a holder of another uid could map it writable. Unit tests of
``WeightSets`` over a host pool (no daemon, no driver)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator

import pytest

from kvpool import protocol as p
from kvpool.daemon.outcome import Fail, Sender
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import TenantRecord, Tenants
from kvpool.daemon.weights import ADMIN_SCOPE, WeightSets
from kvpool.vmm.capabilities import HOST_CAPS
from kvpool.vmm.host import HostBackend

KEY = "c3" * 32
PAGE = 64 * 1024


class SealLessHost(HostBackend):
    """The host backend, claiming only what CUDA claims: read-only maps, no seal."""

    caps = dataclasses.replace(HOST_CAPS, read_only_shares=False)


class MapLessHost(HostBackend):
    """A backend that cannot even map pages read-only: no weight sets at all."""

    caps = dataclasses.replace(HOST_CAPS, read_only_shares=False, read_only_maps=False)


@pytest.fixture
def socks() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def weights(backend: HostBackend, socks: list[socket.socket]
            ) -> tuple[WeightSets, TenantRecord, TenantRecord, TenantRecord]:
    pool = Pool(backend, budget_pages=16)
    tenants = Tenants()

    def tenant(name: str, uid: int, admin: bool) -> TenantRecord:
        a, b = socket.socketpair()
        socks.extend((a, b))
        return tenants.add(token=name, pid=1, uid=uid, gid=uid, conn=a, name=name,
                           kind="engine", registered=True, admin=admin, max_pages=16)

    ws = WeightSets(pool, tenants, owed=lambda: 0)
    return ws, tenant("admin", 0, True), tenant("admin2", 0, True), tenant("other", 1000, False)


SENDER = Sender(identity=b"x", envelope=[b"x"])


def create_and_seal(ws: WeightSets, t: TenantRecord) -> None:
    out = ws.create(t, SENDER, p.WeightCreate(id=1, key=KEY, nbytes=PAGE + 1))
    assert isinstance(out.reply, p.WeightGranted) and out.reply.state == "loading"
    ws.seal(t, SENDER, p.WeightSeal(id=2, key=KEY))


def attach(ws: WeightSets, t: TenantRecord) -> str:
    try:
        out = ws.attach(t, SENDER, p.WeightAttach(id=3, key=KEY))
    except Fail as e:
        return e.code
    assert isinstance(out.reply, p.WeightGranted)
    return out.reply.state


def test_host_keeps_an_admins_set_global(socks: list[socket.socket]) -> None:
    ws, admin, admin2, other = weights(HostBackend(page_size=PAGE), socks)
    try:
        assert ws.shared_across_uids
        create_and_seal(ws, admin)
        assert [s.scope for s in ws.sets.values()] == [ADMIN_SCOPE]
        assert attach(ws, other) == "sealed"  # another uid attaches the admin's sealed set
        assert ws.check(set()) == []
    finally:
        ws.pool.close()


def test_an_admins_set_without_seals_is_its_uids_only(socks: list[socket.socket]) -> None:
    ws, admin, admin2, other = weights(SealLessHost(page_size=PAGE), socks)
    try:
        assert not ws.shared_across_uids
        create_and_seal(ws, admin)
        assert [s.scope for s in ws.sets.values()] == [admin.uid]
        assert attach(ws, other) == p.NOT_FOUND  # another uid: invisible, as if unknown
        assert attach(ws, admin2) == "sealed"  # the admin's own uid shares it
        assert ws.check(set()) == []
    finally:
        ws.pool.close()


def test_a_backend_without_read_only_maps_has_no_sets(socks: list[socket.socket]) -> None:
    ws, admin, admin2, other = weights(MapLessHost(page_size=PAGE), socks)
    try:
        with pytest.raises(Fail) as e:
            ws.create(other, SENDER, p.WeightCreate(id=1, key=KEY, nbytes=PAGE))
        assert e.value.code == p.BAD_REQUEST and "read-only" in str(e.value)
    finally:
        ws.pool.close()


def test_shares_imply_maps() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(HOST_CAPS, read_only_maps=False)
