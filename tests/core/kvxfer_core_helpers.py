"""Helpers shared by the core tests (imported by name: conftest puts this folder on sys.path)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvxfer import CacheClient
    from kvxfer.protocol.messages import StatusReply

#: Small enough for this 2-core machine; 64 tokens per chunk = 4 blocks of 16.
CHUNK_SIZE = 64
BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = CHUNK_SIZE // BLOCK_SIZE


def flash_attn_kv(num_layers: int = 2, num_blocks: int = 32, heads: int = 2, head_size: int = 8,
                  dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    """Per-layer ``[2, num_blocks, BLOCK_SIZE, heads, head_size]`` tensors of random values."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, BLOCK_SIZE, heads, head_size, generator=g).to(dtype)
            for _ in range(num_layers)]


def wait_until(predicate: Callable[[], object], timeout: float, step: float = 0.1) -> object:
    """Poll ``predicate`` until it returns something truthy, and return that; fail (AssertionError
    naming the predicate's source line) if it has not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            try:
                what = inspect.getsource(predicate).strip()
            except Exception:  # noqa: BLE001  (the message must not hide the failure)
                what = repr(predicate)
            raise AssertionError(f"not true within {timeout:g} s (last {value!r}): {what}")
        time.sleep(step)


def after_ticks(client: CacheClient, n: int = 3, timeout: float = 30.0) -> StatusReply:
    """The server's status once it has run ``n`` whole periodic passes (status ``ticks``) after
    this call: what those passes would do (expire leases, drop silent sessions, free parked
    writes) has been done. Fails after ``timeout``."""
    first = client.status().ticks
    st = wait_until(lambda: (s := client.status()).ticks >= first + n and s, timeout, step=0.05)
    assert st, f"the server ran fewer than {n} periodic passes in {timeout} s"
    return st  # type: ignore[return-value]  # the status wait_until saw last


def env_with(path: Path, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that sees the test plugin."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_python(code: str, *args: str, cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``code`` (with ``args``) in a child Python that imports the kvxfer under test and these
    helpers, run from ``cwd`` (a test's own directory: the child's cwd comes first on its path).
    For what could crash or fork the process that runs it: a failing test, not a lost run."""
    import kvxfer

    path = os.pathsep.join([str(Path(kvxfer.__file__).parents[1]), str(Path(__file__).parent)])
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": path})
