"""Encoding and decoding frames: one msgpack frame per message, validated against the
schemas; :func:`decode_request` raises :class:`DecodeError` only (never crashes)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvpool.protocol.bounds import BAD_REQUEST, CODES, MAX_FRAME, MAX_ID
from kvpool.protocol.fd import FdHeader, FdHello
from kvpool.protocol.replies import AnyReply, Error, Reply
from kvpool.protocol.requests import AnyRequest, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)
_hello_decoder = msgspec.msgpack.Decoder(FdHello)
_header_decoder = msgspec.msgpack.Decoder(FdHeader)
_loose_decoder = msgspec.msgpack.Decoder()

encode = _encoder.encode


class DecodeError(ValueError):
    """A frame that is not a valid message; ``id`` is the request id when recoverable."""

    def __init__(self, message: str, id: int = 0, code: str = BAD_REQUEST):
        super().__init__(message)
        self.id = id
        self.code = code


def _salvage_id(frame: bytes) -> int:
    """The ``id`` of an invalid request, when the frame is at least a map with an int id."""
    try:
        obj = _loose_decoder.decode(frame)
    except Exception:
        return 0
    if isinstance(obj, dict):
        value = obj.get("id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ID:
            return value
    return 0


def decode_request(frame: bytes) -> Request:
    """Decode and validate one request frame; raises :class:`DecodeError` only."""
    if len(frame) > MAX_FRAME:
        raise DecodeError(f"message of {len(frame)} bytes exceeds {MAX_FRAME}", _salvage_id(frame[:4096]))
    try:
        return _request_decoder.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise DecodeError(f"invalid request: {e}", _salvage_id(frame)) from None
    except Exception as e:  # defensive: msgspec raises only DecodeError, but never crash
        raise DecodeError(f"invalid request: {type(e).__name__}: {e}", 0) from None


def decode_reply(frame: bytes) -> Reply:
    return _reply_decoder.decode(frame)


def decode_hello(data: bytes) -> FdHello:
    return _hello_decoder.decode(data)


def decode_header(data: bytes) -> FdHeader:
    return _header_decoder.decode(data)


def error(id: int, code: str, message: str) -> Error:
    assert code in CODES, code
    return Error(id=id, code=code, message=message)


def to_builtins(obj: Any) -> Any:
    """Plain dicts/lists for JSON output (CLI ``--json``)."""
    return msgspec.to_builtins(obj)
