"""chunk_hashes: known answers, salt, prefix continuation, full chunks only."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kvxfer import chunk_hashes
from kvxfer.errors import ConfigError

#: Computed once and frozen: a change here breaks every cache already on disk or in a server.
KNOWN = ["0c86e7fd6a55d4968963ea4e06800d37", "b3cf0db5c267c6d4a8e67b058eedc2c4"]
KNOWN_SALTED = ["0d47f8a09ab76c51980af111bcde95bc", "e960b8a9ae601e2f5da38e71178fed47"]


def reference(tokens: list[int], chunk_size: int, salt: bytes = b"") -> list[bytes]:
    """The documented rule, written out independently of kvxfer.hashing."""
    prev = hashlib.blake2b(b"kvxfer-chunk-hash-v1", digest_size=16).digest()
    out = []
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size:(i + 1) * chunk_size]
        prev = hashlib.blake2b(prev + struct.pack(f"<{chunk_size}I", *chunk) + salt, digest_size=16).digest()
        out.append(prev)
    return out


def test_known_answers() -> None:
    assert [h.hex() for h in chunk_hashes(list(range(8)), 4)] == KNOWN
    assert [h.hex() for h in chunk_hashes(list(range(8)), 4, salt=b"tenant-a")] == KNOWN_SALTED


def test_matches_the_documented_rule() -> None:
    tokens = [(i * 7919) % 150_000 for i in range(1000)]
    assert chunk_hashes(tokens, 256) == reference(tokens, 256)
    assert chunk_hashes(tokens, 256, salt=b"s") == reference(tokens, 256, b"s")


def test_only_full_chunks_are_hashed() -> None:
    assert chunk_hashes(list(range(3)), 4) == []
    assert len(chunk_hashes(list(range(11)), 4)) == 2
    assert chunk_hashes(list(range(11)), 4) == chunk_hashes(list(range(8)), 4)


def test_each_hash_names_the_whole_prefix() -> None:
    a = chunk_hashes([1] * 4 + [2] * 4, 4)
    b = chunk_hashes([9] * 4 + [2] * 4, 4)
    assert a[1] != b[1]  # same second chunk, different prefix
    assert len({h for h in a + b}) == 4
    assert all(len(h) == 16 for h in a)


def test_salt_separates_caches() -> None:
    tokens = list(range(16))
    plain, salted = chunk_hashes(tokens, 8), chunk_hashes(tokens, 8, salt="tenant")
    assert not set(plain) & set(salted)
    assert salted == chunk_hashes(tokens, 8, salt=b"tenant")  # str salts are UTF-8


def test_prefix_hash_continues_a_chain() -> None:
    tokens = list(range(40))
    whole = chunk_hashes(tokens, 8)
    first = chunk_hashes(tokens[:16], 8)
    rest = chunk_hashes(tokens[16:], 8, prefix_hash=first[-1])
    assert first + rest == whole


def test_tensors_and_lists_agree() -> None:
    tokens = [5, 70000, 3, 2**31, 0, 1, 2, 2**32 - 1]
    assert chunk_hashes(torch.tensor(tokens), 4) == chunk_hashes(tokens, 4)
    assert chunk_hashes(torch.tensor(tokens, dtype=torch.int64)[::2], 2) == chunk_hashes(tokens[::2], 2)
    assert chunk_hashes(torch.tensor(tokens[:3], dtype=torch.int32), 1) == chunk_hashes(tokens[:3], 1)


def test_tensors_are_hashed_where_numpy_is_not_installed() -> None:
    """torch does not require numpy (a plain ``pip install`` of kvxfer brings none): here its
    import is made to fail as it does where numpy is absent."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['numpy'] = None\n"
            "import warnings; warnings.simplefilter('ignore')\n"
            "import torch\n"
            "from kvxfer.hashing import chunk_hashes\n"
            "print(chunk_hashes(torch.tensor([1, 2, 3, 2**31 + 5]), 2)[-1].hex())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == chunk_hashes([1, 2, 3, 2**31 + 5], 2)[-1].hex()


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        chunk_hashes([1, 2], 0)
    with pytest.raises(ConfigError, match="token_ids"):
        chunk_hashes([-1, 2], 1)
    with pytest.raises(ConfigError, match="1-D"):
        chunk_hashes(torch.zeros(2, 2, dtype=torch.int64), 2)
    # tensors are held to what lists are: no negative ids, none of 2**32 or more, no floats
    with pytest.raises(ConfigError, match="non-negative integers below 2\\*\\*32, got values from -1 to 2"):
        chunk_hashes(torch.tensor([-1, 2]), 1)
    with pytest.raises(ConfigError, match="below 2\\*\\*32"):
        chunk_hashes(torch.tensor([2**32]), 1)
    with pytest.raises(ConfigError, match="must be integers, got a tensor of torch.float32"):
        chunk_hashes(torch.tensor([1.0, 2.0]), 1)


def test_a_salt_holding_a_lone_surrogate_is_hashed_not_raised() -> None:
    """A Python string may hold a lone surrogate (a cache salt, a LoRA name or a multimodal id
    of an in-process engine): encoding it raised UnicodeEncodeError out of vLLM's scheduler.
    It is hashed now, apart from every other salt, and a salt of valid text hashes as before."""
    tokens = list(range(32))
    odd = chunk_hashes(tokens, 16, salt="a\udc80")
    assert len(odd) == 2 and odd != chunk_hashes(tokens, 16, salt="a") and odd != chunk_hashes(tokens, 16)
    assert chunk_hashes(tokens, 16, salt="é") == chunk_hashes(tokens, 16, salt="é".encode())
