"""Helpers of the valkey backend's server-level tests: KV caches, block ids, byte comparisons."""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvxfer import CacheClient
from kvxfer.layout import LayoutKind
from kvxfer.testing.kvdata import KVSpec, as_bytes, get_chunks, make_kv

CHUNK = 32
BLOCK = 16
BPC = CHUNK // BLOCK
TIMEOUT = 30.0
#: 2 layers x 2 planes x 32 tokens x 8 heads x 64 x bf16 = 128 KiB chunks
SPEC = KVSpec(LayoutKind.FLASH_ATTN, "bfloat16", num_layers=2, num_blocks=128, heads=8, head_size=64)


def kv(seed: int) -> list[torch.Tensor]:
    return make_kv(SPEC, "cpu", seed)


def blocks(first_chunk: int, n: int) -> list[int]:
    return list(range(first_chunk * BPC, (first_chunk + n) * BPC))


def chunks(layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The canonical bytes of the chunks held in blocks ``ids``, computed from shapes alone."""
    return get_chunks(as_bytes(layers), SPEC, ids, BPC)


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, step: float = 0.05) -> object:
    """Poll ``predicate`` until it returns something truthy (bounded); returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def tier(client: CacheClient):
    return client.status().tiers[0]


def settle_writes(client: CacheClient, at_least: int, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        t = tier(client)
        if t.writes + t.write_skipped >= at_least and t.queue_depth == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"L2 writes did not settle: {t}")
        time.sleep(0.02)


@contextlib.contextmanager
def loop_tier(url: str, directory: Path, **config: Any) -> Iterator[tuple[Any, Callable[[float], None]]]:
    """A real L2 tier over the store at ``url``, in this process, run as a server's loop runs it:
    yields the tier and ``pump(seconds)``, which polls the descriptors the tier watches, runs
    what it hands the loop and its periodic pass for that long."""
    from kvxfer.arena import Arena
    from kvxfer.server.index import ChunkIndex
    from kvxfer.server.tier import L2Tier, TierConfig

    arena = Arena.create(1 << 20, directory)
    calls: list[Callable[[], None]] = []
    watched: dict[int, Callable[[], None]] = {}
    tier = L2Tier(TierConfig("valkey", url, write_yield_s=0, **config), ChunkIndex(arena.size), arena, calls.append,
                  lambda key: None, watch=lambda fd, cb: watched.__setitem__(fd, cb),
                  unwatch=lambda fd: watched.pop(fd, None))
    tier.start()

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            poller = select.poll()
            for fd in list(watched):
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(5):
                cb = watched.get(fd)
                if cb is not None:
                    cb()
            while calls:
                calls.pop(0)()
            tier.tick()
            if time.monotonic() >= end:
                return

    try:
        yield tier, pump
    finally:
        tier.close()
        arena.close()
