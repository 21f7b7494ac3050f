"""What an L2 value looks like: its key, and a fixed-size header in front of the chunk bytes.

Every chunk in a store is the value ``header || chunk`` under the key :func:`l2_key` of its
server chunk key. The header (:data:`HEADER_SIZE` bytes, little-endian)::

    magic        4s   b"KVXC"
    version      u16  FORMAT_VERSION
    header_size  u16  HEADER_SIZE
    length       u64  bytes of the chunk after the header
    checksum     16s  XXH3-128 of the chunk bytes
    fingerprint  16s  BLAKE2b-128 of (chunk key fields, chunk format): which chunk of which
                      KV layout these bytes are (identity, world size, rank, dtype, shape)
    fmt          128s the chunk format (``KVLayout.chunk_format``: dtype, per-chunk shape and
                      page order), UTF-8, NUL-padded
    reserved     8s   zeros
    header_check u64  XXH3-64 of the 184 bytes above

Keys carry the format version (:data:`KEY_PREFIX`): another version writes under keys of its
own, so versions never read each other's values. A value whose header, fingerprint, length or
checksum does not match what the reader expects is an :class:`IntegrityError`: the tier counts
it as a miss and never loads it. Of those, a :class:`DamagedValue` is one that no reader of its
key can load, in any layout (its bytes or header damaged, a format version other than its key's,
or another chunk's value): the tier also deletes it from the store. An intact header that names
another chunk format is a plain :class:`IntegrityError`: the value may be another server's
(another KV layout of the same model), and is left alone. The chunk bytes are the arena's canonical
chunk, the same for every transport, so any transport on any host can load a chunk stored
through any other.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Sequence
from typing import Final

import msgspec
import xxhash

from kvxfer.layout import DTYPE_SIZES

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "IntegrityError",
    "DamagedValue",
    "Header",
    "l2_key",
    "ChunkL2Keys",
    "fingerprint",
    "encode_header",
    "decode_header",
    "checksum",
    "chunk_format_bytes",
    "CHUNK_FORMAT_MAX_BYTES",
]

FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 192
MAGIC: Final = b"KVXC"
#: Prefix of every key kvxfer writes, with the format version in it (``c1`` for version 1): a
#: value of another version is never under a key of this one. Give kvxfer's Valkey user the key
#: pattern ``~kvxfer:*``.
KEY_PREFIX: Final = b"kvxfer:c%d:" % FORMAT_VERSION

#: Longest chunk format a header records (UTF-8): the server refuses registrations whose
#: format is longer (kvxfer.server.engine.validate_registration).
CHUNK_FORMAT_MAX_BYTES: Final = 128
_FMT_BYTES: Final = CHUNK_FORMAT_MAX_BYTES
_FIXED: Final = struct.Struct(f"<4sHHQ16s16s{_FMT_BYTES}s8s")
_CHECK: Final = struct.Struct("<Q")
assert _FIXED.size + _CHECK.size == HEADER_SIZE
#: ``dtype:AxBxCxD`` and, since layouts record their page order, ``:PAGE`` (printable ASCII)
_FMT_RE: Final = re.compile(r"([a-z0-9_]+):(\d+)x(\d+)x(\d+)x(\d+)(?::[\x21-\x7e]*)?")


class IntegrityError(ValueError):
    """An L2 value that is not the chunk the reader asked for, or is damaged."""


class DamagedValue(IntegrityError):
    """An L2 value that no reader of its key can load, whatever its layout: a damaged header or
    chunk bytes, a length that does not match, or another chunk's value under this key."""


class Header(msgspec.Struct, frozen=True):
    length: int
    checksum: bytes
    fingerprint: bytes
    fmt: str


def _identity(key: Sequence[object]) -> bytes:
    """The chunk key's fields, whatever they are (a NamedTuple), as stable bytes."""
    return msgspec.msgpack.encode(list(key))


@functools.lru_cache(maxsize=1 << 16)
def l2_key(key: Sequence[object]) -> bytes:
    """The store key of a server chunk key: the one place L2 keys are made, from every field of
    the key (so a richer chunk identity changes L2 keys with it). ``key`` must be hashable (a
    ``ChunkKey``); recent keys are remembered (lookups ask about the same chunks again)."""
    return KEY_PREFIX + hashlib.blake2b(_identity(key), digest_size=20).hexdigest().encode()


class ChunkL2Keys:
    """The L2 keys of a chunk for every rank of one model and world size: ``templates`` are the
    ranks' chunk keys with an empty chunk hash (their last field), and ``self(chunk_hash)`` is
    ``tuple(l2_key(t with chunk_hash) for t in templates)``. Each rank's hash starts from a copy
    of one primed with the fields before the chunk hash, so a lookup of thousands of chunks does
    not encode every field of every key again (what :func:`l2_key` does), with the same keys."""

    __slots__ = ("_bases",)

    def __init__(self, templates: Sequence[Sequence[object]]) -> None:
        self._bases = []
        for t in templates:
            head = _identity(t)
            if not head.endswith(_EMPTY_BIN):
                raise ValueError(f"a chunk key template must end with an empty chunk hash, got {t!r}")
            self._bases.append(hashlib.blake2b(head[:-len(_EMPTY_BIN)], digest_size=20))

    def __call__(self, chunk_hash: bytes) -> tuple[bytes, ...]:
        tail = msgspec.msgpack.encode(chunk_hash)
        out = []
        for base in self._bases:
            h = base.copy()
            h.update(tail)
            out.append(KEY_PREFIX + h.hexdigest().encode())
        return tuple(out)


#: How the identity of a chunk key ends when its chunk hash is empty (MessagePack's bin 8 of 0).
_EMPTY_BIN: Final = msgspec.msgpack.encode(b"")


def fingerprint(key: Sequence[object], fmt: str) -> bytes:
    return hashlib.blake2b(_identity(key) + b"\0" + fmt.encode(), digest_size=16).digest()


def checksum(data: memoryview | bytes | bytearray) -> bytes:
    return xxhash.xxh3_128_digest(data)


@functools.lru_cache(maxsize=256)
def chunk_format_bytes(fmt: str) -> int:
    """Bytes of one chunk of format ``fmt`` (``dtype:AxBxCxD[:page]``, the chunk's shape in
    elements); IntegrityError if malformed."""
    m = _FMT_RE.fullmatch(fmt)
    if m is None or m.group(1) not in DTYPE_SIZES:
        raise IntegrityError(f"malformed chunk format {fmt[:80]!r}")
    n = DTYPE_SIZES[m.group(1)]
    for g in m.groups()[1:]:
        n *= int(g)
    return n


def encode_header(key: Sequence[object], fmt: str, payload: memoryview | bytes | bytearray) -> bytes:
    """The header of ``payload``, the chunk of ``key`` in format ``fmt`` (checksums it)."""
    raw_fmt = fmt.encode()
    if len(raw_fmt) > _FMT_BYTES:
        raise ValueError(f"chunk format {fmt!r} is longer than {_FMT_BYTES} bytes")
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, len(payload), checksum(payload),
                       fingerprint(key, fmt), raw_fmt, b"\0" * 8)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(raw: memoryview | bytes | bytearray, key: Sequence[object], fmt: str | None = None) -> Header:
    """Check the header of the value read for ``key``: intact, this format version, this key,
    and (when given) this chunk format; returns it. Raises :class:`DamagedValue` when no reader
    of ``key`` could load the value (bad magic, another format version than the key's, header
    check, a length not its own format's, fingerprint), and a plain :class:`IntegrityError` when
    the header is intact but names a chunk format this reader does not load (or cannot read).
    The payload's checksum is checked separately (:func:`checksum`)."""
    if len(raw) != HEADER_SIZE:
        raise IntegrityError(f"header of {len(raw)} bytes, expected {HEADER_SIZE}")
    body = bytes(raw[:_FIXED.size])
    (check,) = _CHECK.unpack_from(raw, _FIXED.size)
    magic, version, size, length, csum, fp, raw_fmt, _ = _FIXED.unpack(body)
    if magic != MAGIC:
        raise DamagedValue("not a kvxfer chunk (bad magic)")
    if version != FORMAT_VERSION or size != HEADER_SIZE:  # under a key of this version: damaged
        raise DamagedValue(f"chunk format version {version} (header {size} bytes) under a key of version "
                           f"{FORMAT_VERSION}")
    if xxhash.xxh3_64_intdigest(body) != check:
        raise DamagedValue("damaged header (header check mismatch)")
    value_fmt = raw_fmt.rstrip(b"\0").decode("utf-8", "replace")
    # a format this version cannot read (a later kvxfer's dtype, say) may be another server's: left
    # alone, as another layout's; one it reads whose size the length contradicts is damaged
    own_size = chunk_format_bytes(value_fmt)
    if length != own_size:
        raise DamagedValue(f"length {length} does not match the header's own format {value_fmt!r}")
    if fmt is not None and value_fmt != fmt:
        raise IntegrityError(f"stored in format {value_fmt!r}, the reader's layout is {fmt!r}")
    if fp != fingerprint(key, value_fmt):
        raise DamagedValue("fingerprint mismatch: the value belongs to another chunk")
    return Header(length, csum, fp, value_fmt)
