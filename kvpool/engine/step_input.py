"""StepEntry: what one forward pass needs to know of one scheduled sequence.

The scheduler's view of a request (:class:`~kvpool.engine.request.Request`: its whole
token list, sampling parameters, status) stays on the rank that schedules; the forward
pass needs only plain data: the chunk's tokens, where the chunk starts, the block table
that covers it and whether its last row is sampled. A tensor-parallel engine sends
exactly this to its other ranks each step (:mod:`kvpool.engine.tp.messages`), so every
rank builds the same batch from the same entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from kvpool.engine.request import Request


class StepEntry(msgspec.Struct, array_like=True, frozen=True):
    """One sequence's part of a step: ``tokens`` at positions ``[start, start +
    len(tokens))``; ``block_ids`` covers the first ``start + len(tokens)`` positions
    (exactly ``ceil((start + len(tokens)) / block_size)`` blocks); ``samples``: the chunk
    reaches the sequence's last token, so its last row is sampled."""

    start: int
    tokens: list[int]
    block_ids: list[int]
    samples: bool

    @classmethod
    def of(cls, req: Request, n: int, block_size: int) -> StepEntry:
        """The entry of ``n`` tokens of ``req`` from its first uncomputed one."""
        start = req.num_computed_tokens
        end = start + n
        assert len(req.block_ids) * block_size >= end, f"{req} has no room for {n} tokens"
        return cls(start, req.token_ids[start:end], req.block_ids[:-(-end // block_size)],
                   end == req.num_tokens)

    @property
    def end(self) -> int:
        """Context length after this step."""
        return self.start + len(self.tokens)
