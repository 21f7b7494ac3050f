"""Frames and their encoding.

A request is three frames ``[request_id, name, payload]`` (on ``ipc://`` framed by
:mod:`kvxfer.mq.stream`, on ``tcp://`` ZeroMQ message parts); the server puts the connection's
routing id in front. A reply is ``[request_id, status, payload]`` where ``status`` is
``b"ok"`` (payload: the request's reply Struct) or ``b"err"`` (payload: :class:`ErrorReply`).
``request_id`` is 8 bytes chosen by the client. Payloads are MessagePack; nothing is pickled.
"""

from __future__ import annotations

import struct
from functools import cache
from typing import Any, Final, TypeVar

import msgspec

from kvxfer.protocol.messages import ErrorReply

__all__ = ["OK", "ERR", "encode", "decode", "array_length", "pack_id", "unpack_id", "ERROR_DECODER"]

OK: Final = b"ok"
ERR: Final = b"err"

_ID = struct.Struct("<Q")
_ENCODER: Final = msgspec.msgpack.Encoder()

S = TypeVar("S")


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


@cache
def _decoder(tp: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(tp)


def decode(data: bytes | memoryview, tp: type[S]) -> S:
    """Decode ``data`` as ``tp``; raises :class:`msgspec.ValidationError` or
    :class:`msgspec.DecodeError` and nothing else (callers turn those into typed errors).

    Any other failure of the decoder is a :class:`msgspec.DecodeError` too: MessagePack nested
    deeper than the interpreter's recursion limit (msgspec raises ``RecursionError``, also while
    it skips an unknown field or spans a ``Raw`` one), or anything else it may raise."""
    decoder: msgspec.msgpack.Decoder[S] = _decoder(tp)  # type: ignore[arg-type]  # a type is hashable
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise
    except RecursionError:
        raise msgspec.DecodeError("MessagePack nested too deeply (a wire message nests a few levels)") from None
    except Exception as exc:  # noqa: BLE001  (any other decoder failure is bad input too)
        raise msgspec.DecodeError(f"undecodable MessagePack ({type(exc).__name__}: {exc})") from None


ERROR_DECODER: Final = msgspec.msgpack.Decoder(ErrorReply)

_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")


def array_length(raw: msgspec.Raw) -> int:
    """The element count a MessagePack array declares in its header, read without decoding
    any element; ValueError if ``raw`` is no array (or too short to hold its header)."""
    head = memoryview(raw)
    if len(head) >= 1 and 0x90 <= head[0] <= 0x9F:  # fixarray
        return head[0] & 0x0F
    if len(head) >= 3 and head[0] == 0xDC:  # array 16
        return int(_U16.unpack_from(head, 1)[0])
    if len(head) >= 5 and head[0] == 0xDD:  # array 32
        return int(_U32.unpack_from(head, 1)[0])
    raise ValueError("not a MessagePack array")


def pack_id(request_id: int) -> bytes:
    return _ID.pack(request_id)


def unpack_id(frame: bytes) -> int:
    if len(frame) != _ID.size:
        raise ValueError(f"request id must be {_ID.size} bytes, got {len(frame)}")
    return _ID.unpack(frame)[0]
