"""Chunk hashes of token ids: rolling prefix hashes, so the server never sees tokens.

``h_i = BLAKE2b-128(h_{i-1} || tokens_i as little-endian uint32 || salt)`` with ``h_{-1}``
a fixed seed. ``h_i`` therefore names the whole prefix up to chunk ``i``: two requests share
``h_i`` only if their first ``(i + 1) * chunk_size`` tokens (and salts) are equal. Only full
chunks are hashed. Stable across processes, machines and Python versions (no ``hash()``).
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from kvxfer.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["chunk_hashes", "HASH_BYTES"]

HASH_BYTES: Final = 16
_SEED: Final = hashlib.blake2b(b"kvxfer-chunk-hash-v1", digest_size=HASH_BYTES).digest()


def _token_bytes(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported already
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ConfigError(f"token_ids must be 1-D, got shape {list(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ConfigError(f"token_ids must be integers, got a tensor of {token_ids.dtype}")
        wide = token_ids.to(device="cpu", dtype=torch.int64)
        if wide.numel() and not (int(wide.min()) >= 0 and int(wide.max()) < 1 << 32):
            raise ConfigError(f"token_ids must be non-negative integers below 2**32, got values from "
                              f"{int(wide.min())} to {int(wide.max())}")
        # the low 32 bits of each id (int32 keeps them: ids of 2**31 and up wrap to the same bits),
        # read out without numpy, which torch does not require
        low = wide.to(torch.int32).contiguous()
        arr = array("i")
        arr.frombytes(ctypes.string_at(low.data_ptr(), low.numel() * 4))
    else:
        try:
            arr = array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise ConfigError(f"token_ids must be non-negative integers below 2**32: {exc}") from None
        if arr.itemsize != 4:  # pragma: no cover  (no such platform in practice)
            arr = array("L", token_ids)
    if array("I", [1]).tobytes()[0] != 1:  # pragma: no cover  big-endian host
        arr.byteswap()
    return arr.tobytes()


def chunk_hashes(
    token_ids: Sequence[int] | torch.Tensor,
    chunk_size: int,
    *,
    salt: bytes | str = b"",
    prefix_hash: bytes | None = None,
) -> list[bytes]:
    """Rolling hashes of the full ``chunk_size``-token chunks of ``token_ids`` (16 bytes each).

    ``salt`` separates caches that must not share entries (vLLM's per-request ``cache_salt``).
    ``prefix_hash`` continues a chain from an earlier call (the last hash it returned), so a
    caller can hash a growing sequence chunk by chunk.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    # (surrogatepass: a lone surrogate, which Python strings may hold, hashes rather than raises)
    salt_b = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else bytes(salt)
    data = _token_bytes(token_ids)
    step = chunk_size * 4
    prev = _SEED if prefix_hash is None else bytes(prefix_hash)
    out: list[bytes] = []
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(data[start:start + step])
        h.update(salt_b)
        prev = h.digest()
        out.append(prev)
    return out
