"""The chunk book as a hypothesis state machine, no daemon: random takes, frees, grants
(granted or refused), releases and demotions against a model of which blocks are held
and which chunks are mapped; the book's own integrity check runs after every step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.client_lib.chunk_book import ChunkBook


class ChunkBookMachine(RuleBasedStateMachine):
    """Model: ``held`` (block ids taken and not freed), ``mapped`` (chunks granted and not
    released). Everything the book reports must agree with it."""

    @initialize(nchunks=st.integers(1, 6), per_chunk=st.integers(1, 5))
    def make(self, nchunks: int, per_chunk: int) -> None:
        self.book = ChunkBook(nchunks, per_chunk)
        self.per_chunk = per_chunk
        self.held: set[int] = set()
        self.mapped: set[int] = set()

    def held_in(self, chunk: int) -> int:
        return sum(1 for b in self.held if b // self.per_chunk == chunk)

    def free_in_mapped(self) -> int:
        return len(self.mapped) * self.per_chunk - len(self.held)

    # ---- rules ------------------------------------------------------------------------
    @rule(n=st.one_of(st.just(1), st.integers(1, 12)))
    def take(self, n: int) -> None:
        expected_chunk = self.chunk_for_one() if n == 1 else None
        got = self.book.take(n)
        if n > self.free_in_mapped():
            assert got is None, "took more blocks than mapped chunks have free"
            return
        assert got is not None and len(got) == n == len(set(got))
        assert not set(got) & self.held, "a held block was handed out again"
        assert all(b // self.per_chunk in self.mapped for b in got), "block of unmapped chunk"
        if expected_chunk is not None:
            assert got[0] // self.per_chunk in expected_chunk, "not the fullest chunk"
        self.held |= set(got)

    def chunk_for_one(self) -> set[int]:
        """Chunks a single take may come from: the current chunk if it has a free block,
        else the fullest partial chunks, else any empty one."""
        cur = self.book.current
        if cur >= 0 and self.held_in(cur) < self.per_chunk:
            return {cur}
        counts = {c: self.held_in(c) for c in self.mapped}
        partial = {c: k for c, k in counts.items() if 0 < k < self.per_chunk}
        if partial:
            top = max(partial.values())
            return {c for c, k in partial.items() if k == top}
        return {c for c, k in counts.items() if k == 0}

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=3,
                                  unique=True))
        self.book.free(ids)
        self.held -= set(ids)

    @rule(data=st.data())
    def free_bad(self, data) -> None:
        """A list with one block that is not held (or not a block) raises, changing nothing."""
        bad = data.draw(st.one_of(
            st.integers(-3, self.book.num_blocks + 3).filter(lambda b: b not in self.held),
            st.sampled_from(["x", None, 1.5])))
        good = sorted(self.held)[:2]
        before = (self.book.free_count, self.book.in_use, bytes(self.book.held_flags))
        with pytest.raises(ValueError):
            self.book.free([*good, bad])
        assert (self.book.free_count, self.book.in_use, bytes(self.book.held_flags)) == before

    @rule(k=st.integers(1, 4), granted=st.sampled_from([True, True, True, False]))
    def grant(self, k: int, granted: bool) -> None:
        chunks = self.book.pick_unmapped(k)
        if chunks is None:
            assert k > self.book.nchunks - len(self.mapped), "refused with chunks unmapped"
            return
        assert chunks == sorted(chunks) and not set(chunks) & self.mapped
        assert set(chunks) <= self.book.in_flight
        self.book.check_integrity()  # in flight is a state of its own
        if granted:
            self.book.add_mapped(chunks)
            self.mapped |= set(chunks)
        else:
            self.book.return_unmapped(chunks)

    @rule(k=st.integers(1, 4))
    def release(self, k: int) -> None:
        empty_before = set(self.book.empty_chunks()) - {self.book.current}
        chunks = self.book.pop_reserve(k)
        assert len(chunks) == min(k, len(empty_before))
        assert set(chunks) <= empty_before, "released a chunk with held blocks"
        rest = empty_before - set(chunks)
        assert not rest or min(chunks, default=-1) > max(rest), "not the highest first"
        self.book.return_unmapped(chunks)
        self.mapped -= set(chunks)

    @rule()
    def demote_if_empty(self) -> None:
        self.book.demote_if_empty()

    def teardown(self) -> None:
        """Closing forgets everything: every mapped chunk comes back, nothing is held."""
        if not hasattr(self, "book"):
            return
        assert sorted(self.book.drop_all()) == sorted(self.mapped)
        self.held.clear()
        self.mapped.clear()
        self.books_balance()

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def books_balance(self) -> None:
        self.book.check_integrity()
        assert self.book.in_use == len(self.held)
        assert self.book.free_count == self.free_in_mapped()
        assert {b for b in range(self.book.num_blocks) if self.book.is_held(b)} == self.held
        assert set(self.book.mapped_chunks()) == self.mapped
        assert self.book.unmapped_size == self.book.nchunks - len(self.mapped)
        assert self.book.held_by_chunk() == {
            c: self.held_in(c) for c in self.mapped if self.held_in(c)}
        assert set(self.book.empty_chunks()) == {c for c in self.mapped if not self.held_in(c)}


ChunkBookMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_chunk_book = ChunkBookMachine.TestCase


def test_empty_book_is_refused() -> None:
    with pytest.raises(ValueError):
        ChunkBook(0, 4)
