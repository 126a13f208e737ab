"""Request-aligned KV: which allocator chunks belong to which request.

In request-aligned mode every request's blocks come from chunks only it uses (an
allocator chunk is ``pages_per_chunk`` whole units), so its KV can change hands as whole
units (:mod:`.handoff`). A request owns an ordered list of chunks; its blocks fill them
in order, so at most its last chunk is partly used. The blocks of an owned chunk that
the request does not use (yet) are its *spares*: held in the allocator, ref 0, never
given to anyone else. A chunk goes back to the allocator (all blocks freed) once every
block of it is spare again, i.e. when the request let go of all its blocks there.

Invariants: a chunk has at most one owner; ``spare[c]`` is sorted and lies in chunk
``c``; an owner's chunks are listed in the order its blocks fill them.
"""

from __future__ import annotations

import bisect


class RequestChunks:
    """The owner books of a request-aligned pool (no lock: the pool's lock guards it)."""

    def __init__(self, blocks_per_chunk: int) -> None:
        self.per = blocks_per_chunk
        self.owner: dict[int, str] = {}  # chunk -> request id
        self.chunks: dict[str, list[int]] = {}  # request id -> its chunks, in fill order
        self.spare: dict[int, list[int]] = {}  # owned chunk -> its unused blocks, sorted

    def blocks_of(self, c: int) -> range:
        return range(c * self.per, (c + 1) * self.per)

    def spare_of(self, rid: str) -> list[int]:
        """The spare blocks of ``rid``'s last chunk (where its next blocks come from)."""
        chunks = self.chunks.get(rid)
        return self.spare.get(chunks[-1], []) if chunks else []

    def chunks_needed(self, rid: str, n: int) -> int:
        return max(0, -(-(n - len(self.spare_of(rid))) // self.per))

    def take(self, rid: str, n: int, fresh: list[int]) -> list[int]:
        """``n`` blocks for ``rid``: its last chunk's spares first, then ``fresh`` chunks
        (exactly :meth:`chunks_needed` of them, every block held in the allocator)."""
        out: list[int] = []
        spare = self.spare_of(rid)
        k = min(n, len(spare))
        out += spare[:k]
        del spare[:k]
        for c in fresh:
            self.owner[c] = rid
            self.chunks.setdefault(rid, []).append(c)
            blocks = list(self.blocks_of(c))
            k = min(n - len(out), self.per)
            out += blocks[:k]
            self.spare[c] = blocks[k:]
        assert len(out) == n, "fresh chunks do not cover the request"
        return out

    def adopt(self, rid: str, chunks: list[int], used: list[int]) -> None:
        """``rid`` arrives owning ``chunks`` (claimed whole) and using blocks ``used``."""
        assert rid not in self.chunks, f"request {rid!r} owns chunks already"
        inuse = set(used)
        self.chunks[rid] = list(chunks)
        for c in chunks:
            assert c not in self.owner, f"chunk {c} has an owner"
            self.owner[c] = rid
            self.spare[c] = [b for b in self.blocks_of(c) if b not in inuse]

    def release(self, blocks: list[int]) -> tuple[list[int], list[int]]:
        """Blocks whose last reference went: (blocks of unowned chunks, to free now;
        blocks of owned chunks that became wholly spare, to free with their chunk)."""
        loose: list[int] = []
        whole: list[int] = []
        for b in blocks:
            c = b // self.per
            spare = self.spare.get(c)
            if spare is None:
                loose.append(b)
                continue
            bisect.insort(spare, b)
            if len(spare) == self.per:
                whole += spare
                self._disown(c)
        return loose, whole

    def forget(self, rid: str) -> list[int]:
        """Drop ``rid`` and its chunks from the books (they went to another tenant);
        returns the chunks."""
        chunks = list(self.chunks.get(rid, []))
        for c in chunks:
            self._disown(c)
        return chunks

    def _disown(self, c: int) -> None:
        rid = self.owner.pop(c)
        del self.spare[c]
        mine = self.chunks[rid]
        mine.remove(c)
        if not mine:
            del self.chunks[rid]

    @property
    def num_spare(self) -> int:
        return sum(map(len, self.spare.values()))

    def check(self) -> None:
        for rid, chunks in self.chunks.items():
            assert chunks, f"request {rid!r} listed with no chunk"
            for c in chunks:
                assert self.owner.get(c) == rid, f"chunk {c} owner mixed up"
        assert len(self.owner) == sum(map(len, self.chunks.values())), "owner books differ"
        for c, spare in self.spare.items():
            assert c in self.owner, f"spare blocks of unowned chunk {c}"
            assert spare == sorted(set(spare)), f"chunk {c} spares unsorted or doubled"
            assert all(b // self.per == c for b in spare), f"chunk {c} spares stray"
