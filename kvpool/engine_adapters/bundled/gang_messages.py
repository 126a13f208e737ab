"""What rank 0's adapter tells the other ranks of a tensor-parallel engine whose KV cache
is a kvpool gang (docs/ARCHITECTURE.md, "Gangs"); carried as the engine's ``Adapter``
frames (:mod:`kvpool.engine.tp_messages`), on the private pipe from rank 0 to each rank.

* :class:`Join`: join the gang (the token is a capability: it travels only on this pipe)
  and create the layout's region group, before rank 0's first grant;
* :class:`Grant` / :class:`Release`: this rank's part of the collective grant or release
  rank 0 is about to ask for (the same units, in order).
"""

from __future__ import annotations

import msgspec


class Join(msgspec.Struct, tag="join", frozen=True):
    """Register as this rank (``r``) of gang ``token`` named ``name`` on ``devices[r]``
    of the daemon at ``run_dir``, then create the one region group of ``n_regions`` x
    ``capacity`` bytes (``label``) the gang's layout names."""

    token: str
    name: str
    devices: list[int]
    run_dir: str | None
    n_regions: int
    capacity: int
    label: str


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
