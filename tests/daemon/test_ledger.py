"""The ledger, the one owner of page moves (docs/ARCHITECTURE.md, "One owner of page
moves"): every verb does all the steps of its move (pool ownership, the tenant's
counts, the pages given back counted against an ask), the unit checks refuse before
anything moves, and ``Ledger.check`` (run by ``kvpool check``) finds a planted break of
the accounting invariant. Unit tests over a real host pool (no daemon)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvpool import protocol as p
from kvpool.daemon.ledger import MAX_PAGES_PER_GRANT, Ledger
from kvpool.daemon.outcome import Fail
from kvpool.daemon.pool import Pool
from kvpool.daemon.regions import GroupRecord
from kvpool.daemon.tenants import TenantRecord, Tenants
from kvpool.vmm.host import HostBackend

PAGE = 64 * 1024


class NoSets:
    """No weight sets (the ledger's check sees only tables)."""

    pages = 0

    def check(self, seen: set[int]) -> list[str]:
        return []


class Book:
    """A pool with its ledger and two tenants, each with one two-region group."""

    def __init__(self, socks: list[socket.socket]):
        self.pool = Pool(HostBackend(), budget_pages=32)
        self.given: list[tuple[int, int]] = []  # (tenant id, pages) the reclaimer heard
        self.ledger = Ledger(self.pool, released=lambda t, n: self.given.append((t.id, n)))
        self.tenants = Tenants()
        self.a, self.ga = self.tenant("a", socks)
        self.b, self.gb = self.tenant("b", socks)

    def tenant(self, name: str, socks: list[socket.socket]
               ) -> tuple[TenantRecord, GroupRecord]:
        x, y = socket.socketpair()
        socks.extend((x, y))
        t = self.tenants.add(token=name, pid=1, uid=1000, gid=1000, conn=x, name=name,
                             kind="engine", registered=True, max_pages=32)
        g = GroupRecord(id=len(self.tenants), tenant=t.id, n_regions=2, npages=8)
        t.groups[g.id] = g
        return t, g

    def grant(self, t: TenantRecord, g: GroupRecord, units: list[int]) -> list[int]:
        n = self.ledger.grantable(g, units)
        pfns = self.ledger.take(t, n)
        self.ledger.commit(t, g, p.Grant(id=1, group=g.id, units=units), pfns)
        return pfns

    def check(self) -> list[str]:
        return self.ledger.check(self.tenants, NoSets())


@pytest.fixture
def book() -> Iterator[Book]:
    socks: list[socket.socket] = []
    b = Book(socks)
    yield b
    b.pool.close()
    for s in socks:
        s.close()


def test_every_verb_keeps_the_accounting(book: Book) -> None:
    a, b, ga, gb, ledger = book.a, book.b, book.ga, book.gb, book.ledger
    pfns = book.grant(a, ga, [0, 1, 2])
    assert a.granted == 6 and all(book.pool.owner[x] == a.id for x in pfns)
    assert book.check() == []
    assert ledger.release(a, ga, [2], in_use=0, reserve=[1]) == 2
    assert a.granted == 4 and ga.reserve == {1} and book.given == [(a.id, 2)]
    moved = ledger.move(a, ga, [0], b, gb, [5])
    assert moved == pfns[:2] and gb.units[5] == moved
    assert (a.granted, b.granted) == (2, 2) and all(book.pool.owner[x] == b.id for x in moved)
    assert book.given == [(a.id, 2), (a.id, 2)]  # the giver's ask counts what it handed over
    assert book.check() == []
    ledger.lease(b, 3)
    assert (b.lease_pages, book.pool.leased) == (3, 3)
    ledger.unlease(b, 1)
    assert (b.lease_pages, book.pool.leased) == (2, 2)
    assert book.check() == []
    assert ledger.empty(a, ga) == 2 and a.granted == 0 and ga.units == {}
    assert ledger.end(b) == 2
    assert (b.granted, b.lease_pages, book.pool.leased, book.pool.granted) == (0, 0, 0, 0)
    assert book.check() == []


def test_a_reservation_given_back_leaves_nothing(book: Book) -> None:
    pfns = book.ledger.take(book.a, 4)
    assert book.pool.granted == 4
    book.ledger.untake(book.a, pfns)
    assert book.pool.granted == 0 and book.a.granted == 0 and book.check() == []


@pytest.mark.parametrize("units,words", [
    ([1, 1], "named twice"), ([8], "outside the group"), ([0], "already granted"),
])
def test_a_grant_is_refused_before_anything_moves(book: Book, units: list[int],
                                                  words: str) -> None:
    book.grant(book.a, book.ga, [0])
    before = (book.pool.granted, book.a.granted, dict(book.ga.units))
    with pytest.raises(Fail) as e:
        book.ledger.grantable(book.ga, units)
    assert e.value.code == p.BAD_REQUEST and words in str(e.value)
    assert (book.pool.granted, book.a.granted, dict(book.ga.units)) == before


def test_a_grant_past_the_page_cap_is_refused(book: Book) -> None:
    big = GroupRecord(id=9, tenant=book.a.id, n_regions=2, npages=MAX_PAGES_PER_GRANT)
    with pytest.raises(Fail) as e:
        book.ledger.grantable(big, list(range(MAX_PAGES_PER_GRANT // 2 + 1)))
    assert e.value.code == p.BAD_REQUEST and "exceed" in str(e.value)


def test_a_release_of_units_not_held_is_refused(book: Book) -> None:
    book.grant(book.a, book.ga, [0])
    with pytest.raises(Fail) as e:
        book.ledger.releasable(book.ga, [0, 3])
    assert e.value.code == p.BAD_REQUEST and "unit 3" in str(e.value)
    assert book.a.granted == 2


def test_check_finds_a_count_that_lies(book: Book) -> None:
    book.grant(book.a, book.ga, [0])
    book.a.granted += 1
    assert any("counts 3 pages, its tables hold 2" in x for x in book.check())


def test_check_finds_a_page_owned_by_another(book: Book) -> None:
    pfns = book.grant(book.a, book.ga, [0])
    book.pool.owner[pfns[0]] = book.b.id
    assert any(f"pfn {pfns[0]} in tenant {book.a.id}'s table is owned by {book.b.id}" in x
               for x in book.check())


def test_check_finds_a_lease_the_pool_does_not_count(book: Book) -> None:
    book.a.lease_pages = 2
    assert any("tenants lease 2 pages, the pool counts 0" in x for x in book.check())


def test_check_finds_a_page_in_no_table(book: Book) -> None:
    book.ledger.take(book.a, 2)  # reserved, never committed nor given back
    problems = book.check()
    assert any("granted but in no table" in x for x in problems)
    assert any("hold 0 pages, the pool counts 2" in x for x in problems)
