"""The chunk book: which blocks are held, free or unmapped. Pure state: no lock, no I/O.

A *chunk* is ``blocks_per_chunk`` consecutive blocks (block ``b`` lives in chunk
``b // blocks_per_chunk``); memory is granted and released in whole chunks. Every chunk
is in exactly one state:

* *unmapped*  — in ``_unmapped`` (a min-heap: low addresses are reused first);
* *in flight* — in ``_in_flight``: being granted or released by some thread;
* *current*   — ``_current``: the mapped chunk blocks are taken from first;
* *partial*   — in ``_partial[k]`` where ``k`` is its count of held blocks
  (0 < k < blocks_per_chunk): mapped, some blocks free and some held;
* *full*      — mapped, every block held (tracked by ``_used`` only);
* *reserve*   — in ``_reserve``: mapped, no block held.

A mapped chunk has a free list (``_free_lists[c]``, None when not mapped); the current
chunk's is also ``_current_free``. Blocks come from the current chunk; when it runs out,
or when frees leave it emptier than some partial chunk, the fullest partial chunk
becomes current (so emptier chunks drain into the reserve), else a reserve chunk.
``free_count`` counts free blocks of mapped chunks, ``in_use`` held blocks.

The owner (:class:`~kvpool.client_lib.allocator.ElasticBlockAllocator`) serializes every
call with its lock and does the I/O: it moves chunks unmapped -> in flight
(:meth:`pick_unmapped`), in flight -> reserve once granted and mapped (:meth:`add_mapped`),
reserve -> in flight before releasing (:meth:`pop_reserve`) and in flight -> unmapped
(:meth:`return_unmapped`). :meth:`check_integrity` asserts all of the above.

*Whole chunks for one owner* (request-aligned KV, page handoff between tenants): chunks
whose every block one owner holds, so their units hold nothing else and can be handed to
another tenant or taken from one. :meth:`take_empty_chunks` turns empty mapped chunks
into such chunks, :meth:`adopt_chunks` maps in-flight chunks (a claim, a whole-chunk
grant) straight into that state, and :meth:`forget_chunks` drops mapped chunks another
tenant claimed.
"""

from __future__ import annotations

import heapq
from typing import Iterable

_EMPTY: list[int] = []


class ChunkBook:
    def __init__(self, nchunks: int, blocks_per_chunk: int) -> None:
        if nchunks <= 0 or blocks_per_chunk <= 0:
            raise ValueError("a chunk book needs at least one chunk of at least one block")
        self.nchunks = nchunks
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = nchunks * blocks_per_chunk
        self._held = bytearray(self.num_blocks)
        self._used = [0] * nchunks  # held blocks per chunk
        self._free_lists: list[list[int] | None] = [None] * nchunks
        self._current = -1
        self._current_free: list[int] = _EMPTY
        self._partial: list[set[int]] = [set() for _ in range(blocks_per_chunk)]
        self._fullest = 0  # no _partial[k] with k above this is non-empty
        self._reserve: list[int] = []
        self._unmapped: list[int] = list(range(nchunks))  # sorted, hence a heap
        self._in_flight: set[int] = set()
        self.free_count = 0
        self.in_use = 0
        self.ops = 0  # take/free calls (idleness is "ops did not change")

    # ---- blocks --------------------------------------------------------------------
    def take(self, n: int) -> list[int] | None:
        """``n >= 1`` free blocks, now held; None (changing nothing) if fewer are free."""
        self.ops += 1
        free = self._current_free
        if n == 1 and free:  # the common case
            b = free.pop()
            self._held[b] = 1
            self._used[self._current] += 1
            self.free_count -= 1
            self.in_use += 1
            return [b]
        if n > self.free_count:
            return None
        out: list[int] = []
        held = self._held
        while len(out) < n:
            if not free:
                free = self._next_chunk()
            k = min(len(free), n - len(out))
            got = free[-k:]
            del free[-k:]
            for b in got:
                held[b] = 1
            self._used[self._current] += k
            out += got
        self.free_count -= n
        self.in_use += n
        return out

    def free(self, ids: list[int]) -> None:
        """Give held blocks back. Raises ValueError (changing nothing) if one is not held."""
        held = self._held
        i = 0
        try:
            for i, b in enumerate(ids):
                if b < 0 or not held[b]:
                    raise ValueError(f"free: block {b!r} is not held")
                held[b] = 0
        except (ValueError, IndexError, TypeError) as e:
            for b2 in ids[:i]:
                held[b2] = 1
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"free: block {ids[i]!r} is not a block id") from None
        per_chunk, used, partial = self.blocks_per_chunk, self._used, self._partial
        current = self._current
        free_lists = self._free_lists
        for b in ids:
            c = b // per_chunk
            u = used[c] - 1
            used[c] = u
            fl = free_lists[c]
            assert fl is not None, "a held block lies in a mapped chunk"
            fl.append(b)
            if c == current:
                continue
            if u + 1 < per_chunk:
                partial[u + 1].discard(c)
            if u == 0:
                self._reserve.append(c)
            else:
                partial[u].add(c)
                if u > self._fullest:
                    self._fullest = u
        if current >= 0 and used[current] < self._fullest:
            self._demote()  # a fuller partial chunk exists: take blocks from it next
        self.free_count += len(ids)
        self.in_use -= len(ids)
        self.ops += 1

    def is_held(self, block: int) -> bool:
        return bool(self._held[block])

    @property
    def held_flags(self) -> bytearray:
        """One byte per block, nonzero when held (read it, never write it)."""
        return self._held

    # ---- the current chunk --------------------------------------------------------------
    @property
    def current(self) -> int:
        """The chunk blocks are taken from first, or -1."""
        return self._current

    def _next_chunk(self) -> list[int]:
        """Make the fullest partial chunk (else a reserve chunk) current."""
        partial, k = self._partial, self._fullest
        while k > 0 and not partial[k]:
            k -= 1
        self._fullest = k
        c = partial[k].pop() if k > 0 else self._reserve.pop()
        fl = self._free_lists[c]
        assert fl is not None, "partial and reserve chunks are mapped"
        self._current, self._current_free = c, fl
        return fl

    def _demote(self) -> None:
        """The current chunk goes back to its partial set (or the reserve)."""
        c, u = self._current, self._used[self._current]
        if u == 0:
            self._reserve.append(c)
        elif u < self.blocks_per_chunk:
            self._partial[u].add(c)
            self._fullest = max(self._fullest, u)
        self._current, self._current_free = -1, _EMPTY

    def demote_if_empty(self) -> None:
        """An empty current chunk joins the reserve (so it can be released)."""
        if self._current >= 0 and self._used[self._current] == 0:
            self._demote()

    # ---- chunks ---------------------------------------------------------------------
    def pick_unmapped(self, k: int) -> list[int] | None:
        """``k`` unmapped chunks, lowest first, now in flight; None (no change) if fewer."""
        if k > len(self._unmapped):
            return None
        chunks = [heapq.heappop(self._unmapped) for _ in range(k)]
        self._in_flight.update(chunks)
        return chunks

    def add_mapped(self, chunks: Iterable[int]) -> None:
        """In-flight chunks are granted and mapped: they join the reserve, all blocks free."""
        per_chunk = self.blocks_per_chunk
        for c in chunks:
            self._in_flight.discard(c)
            self._free_lists[c] = list(range((c + 1) * per_chunk - 1, c * per_chunk - 1, -1))
            self._used[c] = 0
            self._reserve.append(c)
            self.free_count += per_chunk

    def pop_reserve(self, k: int) -> list[int]:
        """Up to ``k`` reserve chunks, highest addresses first, now in flight (to release)."""
        self._reserve.sort()
        chunks = self._reserve[-k:] if k > 0 else []
        del self._reserve[len(self._reserve) - len(chunks):]
        for c in chunks:
            self._free_lists[c] = None
        self._in_flight.update(chunks)
        self.free_count -= self.blocks_per_chunk * len(chunks)
        return chunks

    def return_unmapped(self, chunks: Iterable[int]) -> None:
        """In-flight chunks (a refused grant, a finished release) are unmapped again."""
        for c in chunks:
            self._in_flight.discard(c)
            heapq.heappush(self._unmapped, c)

    def drop_all(self) -> list[int]:
        """Forget every mapped chunk (held blocks included); returns them, now unmapped."""
        chunks = self.mapped_chunks()
        for c in chunks:
            self._free_lists[c] = None
            self._used[c] = 0
            heapq.heappush(self._unmapped, c)
        self._held = bytearray(self.num_blocks)
        self._reserve.clear()
        for s in self._partial:
            s.clear()
        self._current, self._current_free = -1, _EMPTY
        self.free_count = self.in_use = 0
        return chunks

    # ---- whole chunks for one owner (handoff) ---------------------------------------
    def take_empty_chunks(self, k: int) -> list[int] | None:
        """``k >= 1`` mapped empty chunks (an empty current one joins the reserve first),
        every block of them now held: whole units for one owner. None (no change) if
        fewer are empty."""
        self.demote_if_empty()
        if k > len(self._reserve):
            return None
        chunks = self._reserve[len(self._reserve) - k:]
        del self._reserve[len(self._reserve) - k:]
        for c in chunks:
            fl = self._free_lists[c]
            assert fl is not None and len(fl) == self.blocks_per_chunk, "reserve chunks are empty"
            fl.clear()
            self._hold_whole(c)
        self.free_count -= k * self.blocks_per_chunk
        return chunks

    def adopt_chunks(self, chunks: Iterable[int]) -> None:
        """In-flight chunks just mapped for one owner (a claim, a whole-chunk grant):
        mapped, every block held."""
        for c in chunks:
            assert c in self._in_flight, f"adopt: chunk {c} is not in flight"
            self._in_flight.discard(c)
            self._free_lists[c] = []
            self._hold_whole(c)

    def forget_chunks(self, chunks: Iterable[int]) -> None:
        """Mapped chunks whose pages went to another tenant: unmapped, nothing held (their
        held blocks are dropped, as the owner no longer has them). Raises ValueError
        (changing nothing) if one is not mapped or is listed twice."""
        chunks = list(chunks)
        per = self.blocks_per_chunk
        if len(set(chunks)) != len(chunks):
            raise ValueError("forget: a chunk is listed twice")
        for c in chunks:
            if not (isinstance(c, int) and 0 <= c < self.nchunks) or \
                    self._free_lists[c] is None:
                raise ValueError(f"forget: chunk {c!r} is not mapped")
        for c in chunks:
            fl, u = self._free_lists[c], self._used[c]
            assert fl is not None
            if c == self._current:
                self._current, self._current_free = -1, _EMPTY
            elif u == 0:
                self._reserve.remove(c)
            elif u < per:
                self._partial[u].discard(c)
            self.free_count -= len(fl)
            self.in_use -= u
            self._free_lists[c] = None
            self._used[c] = 0
            self._held[c * per:(c + 1) * per] = bytes(per)
            heapq.heappush(self._unmapped, c)
        self.ops += 1

    def _hold_whole(self, c: int) -> None:
        per = self.blocks_per_chunk
        self._held[c * per:(c + 1) * per] = b"\x01" * per
        self._used[c] = per
        self.in_use += per
        self.ops += 1

    # ---- views ----------------------------------------------------------------------
    def empty_chunks(self) -> list[int]:
        """Mapped chunks with no held block: the reserve and an empty current chunk."""
        out = list(self._reserve)
        if self._current >= 0 and self._used[self._current] == 0:
            out.append(self._current)
        return out

    def mapped_chunks(self) -> list[int]:
        return [c for c, f in enumerate(self._free_lists) if f is not None]

    def held_by_chunk(self) -> dict[int, int]:
        """Mapped chunks with held blocks -> how many blocks each holds."""
        return {c: u for c, u in enumerate(self._used) if u and self._free_lists[c] is not None}

    @property
    def reserve_size(self) -> int:
        return len(self._reserve)

    @property
    def unmapped_size(self) -> int:
        return len(self._unmapped)

    @property
    def in_flight(self) -> frozenset[int]:
        return frozenset(self._in_flight)

    # ---- self-check -----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every chunk is in exactly one state (module doc)
        and the counts, free lists and held flags agree."""
        unmapped, reserve = set(self._unmapped), set(self._reserve)
        assert len(unmapped) == len(self._unmapped), "a chunk is unmapped twice"
        assert len(reserve) == len(self._reserve), "a chunk is in the reserve twice"
        partial = set().union(*self._partial)
        assert sum(map(len, self._partial)) == len(partial), "a chunk is in two partial sets"
        assert not self._partial[0], "partial set 0 is not used"
        current = {self._current} if self._current >= 0 else set()
        states = [unmapped, self._in_flight, reserve, partial, current]
        for i, a in enumerate(states):
            for b in states[i + 1:]:
                assert not a & b, f"chunk states overlap: {sorted(a & b)[:8]}"
        free_count = in_use = 0
        for c in range(self.nchunks):
            free, held = self._check_chunk(c, unmapped, reserve, partial)
            free_count += free
            in_use += held
        assert free_count == self.free_count, f"free count {self.free_count} != {free_count}"
        assert in_use == self.in_use, f"in-use count {self.in_use} != {in_use}"

    def _check_chunk(self, c: int, unmapped: set[int], reserve: set[int],
                     partial: set[int]) -> tuple[int, int]:
        """(free, held) blocks of chunk ``c`` after asserting its state matches them."""
        per_chunk = self.blocks_per_chunk
        fl = self._free_lists[c]
        blocks = range(c * per_chunk, (c + 1) * per_chunk)
        held = sum(self._held[b] for b in blocks)
        if fl is None:
            assert held == 0, f"unmapped chunk {c} has held blocks"
            assert c in unmapped or c in self._in_flight, f"chunk {c} is lost"
            return 0, 0
        assert c not in unmapped, f"mapped chunk {c} is also unmapped"
        assert len(set(fl)) == len(fl), f"chunk {c} lists a free block twice"
        assert all(b in blocks and not self._held[b] for b in fl), f"chunk {c} free list"
        assert held + len(fl) == per_chunk, f"chunk {c}: {held} held + {len(fl)} free"
        assert self._used[c] == held, f"chunk {c}: used {self._used[c]} != held {held}"
        if c == self._current:
            assert self._current_free is fl, "current free list is stale"
        elif held == 0:
            assert c in reserve, f"empty chunk {c} not in reserve"
        elif held < per_chunk:
            assert c in self._partial[held], f"partial chunk {c} not in partial set {held}"
            assert held <= self._fullest, f"fullest {self._fullest} below a partial set"
        else:
            assert c not in partial and c not in reserve, f"full chunk {c} listed"
        return len(fl), held
