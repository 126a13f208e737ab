"""What rank 0's adapter tells the other ranks of a tensor-parallel engine whose KV cache
is a kvpool gang (docs/ARCHITECTURE.md, "Gangs"); carried as the engine's ``Adapter``
frames (:mod:`kvpool.engine.tp.messages`), on the private pipe from rank 0 to each rank.

* :class:`Join`: join the gang (the token is a capability: it travels only on this pipe)
  and create the layout's region group, before rank 0's first grant;
* :class:`Grant` / :class:`Release`: this rank's part of the collective grant or release
  rank 0 is about to ask for (the same units, in order).

:class:`PipeCollective` is the bundled engine's transport for the gang driver
(:class:`~kvpool.engine_adapters.gang.Collective`): it posts a grant's or release's part
as these messages and answers nothing (the daemon's reply to rank 0's own part answers
for every rank).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from kvpool.engine_adapters.gang import GangOp, GrantOp, RankGone, ReleaseOp


class Join(msgspec.Struct, tag="join", frozen=True):
    """Register as this rank (``r``) of gang ``token`` named ``name`` on ``devices[r]``
    of the daemon at ``run_dir``, then create the one region group of ``n_regions`` x
    ``capacity`` bytes (``label``) the gang's layout names; its KV blocks are
    ``block_stride`` bytes apart in each region (rank 0's padded block), granted
    ``chunk_units`` units at a time."""

    token: str
    name: str
    devices: list[int]
    run_dir: str | None
    n_regions: int
    capacity: int
    label: str
    block_stride: int
    chunk_units: int = 1


class Grant(msgspec.Struct, tag="grant", frozen=True):
    """Grant and map ``units`` of the group (this rank's part)."""

    units: list[int]


class Release(msgspec.Struct, tag="release", frozen=True):
    """Unmap ``units`` of the group and give them back (this rank's part)."""

    units: list[int]


GangMessage = Join | Grant | Release

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GangMessage)


def encode(msg: GangMessage) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> GangMessage:
    """Raises msgspec.DecodeError for a payload that is not one (a bug: the pipe is
    private to rank 0 and this rank)."""
    return _decoder.decode(payload)


class Ranks(Protocol):
    """The other ranks (``TPWorkers``): ``post(payload)`` delivers to every one, in
    order with the engine's steps; raises RuntimeError when a rank is gone."""

    def post(self, payload: bytes) -> None: ...


class PipeCollective:
    """The gang driver's transport over the ranks' pipes: a grant or release is posted
    to every other rank as :class:`Grant` / :class:`Release` (each rank applies it in
    pipe order, :mod:`.gang_rank`); a usage report is rank 0's alone (not posted).
    Returns no answers; a rank that is gone raises
    :class:`~kvpool.engine_adapters.gang.RankGone`."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def __call__(self, op: GangOp) -> list[str | None]:
        msg: GangMessage
        if isinstance(op, GrantOp):
            msg = Grant(list(op.units))
        elif isinstance(op, ReleaseOp):
            msg = Release(list(op.units))
        else:
            return []
        try:
            self.ranks.post(encode(msg))
        except RuntimeError as e:
            raise RankGone(str(e)) from None
        return []
