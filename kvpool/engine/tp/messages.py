"""The messages rank 0 of a tensor-parallel engine sends its other ranks, and their
framing on the pipe between them.

Rank 0 (:mod:`kvpool.engine.tp.workers`) starts each other rank as a process
(:mod:`kvpool.engine.tp.rank`) with a :class:`RankSpec` on its command line and writes
frames to its stdin: one :class:`Setup` once its block pool exists, then one
:class:`Step` per engine step (the entries every rank runs; the ranks meet in the
model's collectives during the step), and :class:`Stop` (or end of file: rank 0 is gone)
to end. :class:`Adapter` frames (an adapter's own messages, opaque here) may come at any
time, in order with the others. A frame is a 4-byte big-endian length and a msgpack-encoded message; the pipe
is private to the two processes (nothing else can write it), so decoding errors mean a
bug, and end the rank.
"""

from __future__ import annotations

import struct
from typing import IO

import msgspec

from kvpool.engine.kv_cache import KVLayout
from kvpool.engine.step_input import StepEntry

_LEN = struct.Struct(">I")


class RankSpec(msgspec.Struct, frozen=True):
    """What a rank process needs to build its share of the engine (its command line, as
    JSON): the checkpoint ``model``, ``device``, ``dtype`` (a torch dtype's name),
    ``rank`` of ``size``, the TCP store rank 0 opened (``host``, ``port``), the runner's
    options and the torch threads it may use."""

    model: str
    device: str
    dtype: str
    rank: int
    size: int
    host: str
    port: int
    block_size: int
    attention_backend: str
    max_num_batched_tokens: int
    prepack: bool
    threads: int


class Setup(msgspec.Struct, tag="setup", frozen=True):
    """The KV cache to build: ``num_blocks`` blocks of ``block_size`` in ``layout`` (each
    rank holds its KV heads of every block; the block ids are rank 0's)."""

    num_blocks: int
    layout: KVLayout


class Step(msgspec.Struct, tag="step", frozen=True):
    """Run one forward pass over ``entries`` (in this order)."""

    entries: list[StepEntry]


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """Leave the group and exit."""


class Adapter(msgspec.Struct, tag="adapter", frozen=True):
    """For the rank's :class:`~kvpool.engine.tp.rank.RankHooks` (an adapter's message,
    encoded by the adapter)."""

    payload: bytes


Message = Setup | Step | Stop | Adapter

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def write(out: IO[bytes], msg: Message) -> None:
    """One frame; flushed."""
    body = _encoder.encode(msg)
    out.write(_LEN.pack(len(body)) + body)
    out.flush()


def read(src: IO[bytes]) -> Message | None:
    """The next message; None at end of file (rank 0 closed the pipe or exited).

    Raises:
        msgspec.DecodeError: a frame that is not a message (cut short, or garbage).
    """
    head = src.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = src.read(n)
    if len(body) < n:
        return None
    return _decoder.decode(body)
