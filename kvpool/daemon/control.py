"""The control socket (ZeroMQ ROUTER): reading requests and sending replies, never
blocking and never buffering a hostile message whole.

Up to ``burst`` messages are read per loop turn, frame by frame: a message of more than
:data:`MAX_FRAMES` frames is refused (``BAD_REQUEST``) and its rest discarded unread,
``drain_slice`` frames per turn; once a long one is gone the heap is trimmed
(:func:`trim_heap`), so the memory libzmq took to assemble it returns to the system. A REQ socket's empty delimiter is kept in the reply's
envelope. Anything that does not decode gets its error reply here; a decoded request
goes to the ``receive`` callback (``Server.receive``). Replies are sent non-blocking:
a peer past its high-water mark loses the reply, the loop never waits for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from typing import Callable

import zmq

from kvpool import protocol as p
from kvpool.daemon.counters import Counters

log = logging.getLogger("kvpool.daemon")

MAX_FRAMES = 4  # frames of one control message: identity, [empty delimiter], body (+1 spare)
TRIM_AFTER = 65536  # frames: a refused message this long gives the heap back when discarded


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``).

    libzmq assembles a multipart message whole before the daemon sees its first frame
    (a message is delivered atomically), about 64 bytes per frame; once such a message
    is discarded the memory is free but glibc keeps it mapped, so without this the
    daemon's resident size stays at its peak for good. A no-op where there is no glibc.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)


# (identity, envelope, request): a decoded request for the loop to serve
Receive = Callable[[bytes, list[bytes], p.Request], None]


class Control:
    """Reads ``router`` (``burst`` messages a turn, ``drain_slice`` frames of a refused
    one) and hands decoded requests to ``receive``; refusals are counted in
    ``counters``."""

    def __init__(self, router: zmq.Socket[bytes], counters: Counters, receive: Receive,
                 burst: int, drain_slice: int):
        self.router = router
        self.counters = counters
        self.receive = receive
        self.discard: list[int] | None = None  # [frames read] of a refused message
        self._burst = burst
        self._drain_slice = drain_slice

    @property
    def readable(self) -> bool:
        return bool(int(self.router.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def read(self) -> None:
        """Up to ``burst`` messages (finishing the discard of a refused one first)."""
        for _ in range(self._burst):
            if self.discard is not None and not self._drain():
                return
            try:
                frames = self._recv_frames()
            except zmq.Again:
                return
            if frames is not None:
                self._message(frames)

    def reply(self, envelope: list[bytes], reply: p.Reply | bytes) -> None:
        frame = reply if isinstance(reply, bytes) else p.encode(reply)
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([*envelope, frame], zmq.NOBLOCK)

    def refuse(self, envelope: list[bytes], req_id: int, code: str, message: str,
               request: bool = True) -> None:
        """An error reply the arbiter never saw (counted as a request when ``request``)."""
        self.counters.requests += int(request)
        self.counters.errors += 1
        self.reply(envelope, p.error(req_id, code, message))

    def _recv_frames(self) -> list[bytes] | None:
        frames = [self.router.recv(zmq.NOBLOCK)]
        while self.router.getsockopt(zmq.RCVMORE):
            if len(frames) == MAX_FRAMES:
                envelope = frames[:2] if frames[1] == b"" else frames[:1]
                self.refuse(envelope, 0, p.BAD_REQUEST,
                            f"a message has at most {MAX_FRAMES - 1} frames")
                self.discard = [len(frames)]
                return None
            frames.append(self.router.recv(zmq.NOBLOCK))
        return frames

    def _drain(self) -> bool:
        """Discard up to ``drain_slice`` frames of a refused message; True once done."""
        assert self.discard is not None
        for _ in range(self._drain_slice):
            frame = self.router.recv(zmq.NOBLOCK, copy=False)  # (freed at once)
            self.discard[0] += 1
            if not frame.more:
                log.warning("discarded a control message of %d frames", self.discard[0])
                if self.discard[0] >= TRIM_AFTER:
                    trim_heap()
                self.discard = None
                return True
        return False

    def _message(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        envelope = [identity]
        if len(body) == 2 and body[0] == b"":  # a REQ socket's empty delimiter
            envelope.append(b"")
            body = body[1:]
        if len(body) != 1:
            self.refuse(envelope, 0, p.BAD_REQUEST, f"expected one frame, got {len(body)}",
                        request=False)
            return
        try:
            req = p.decode_request(body[0])
        except p.DecodeError as e:
            self.refuse(envelope, e.id, e.code, str(e))
            return
        self.receive(identity, envelope, req)
