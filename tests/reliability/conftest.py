"""Fixtures of the reliability tests: real server processes, real client processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import relkit  # noqa: E402
from kvxfer import CacheClient  # noqa: E402
from kvxfer.testing.server import ServerProcess  # noqa: E402


@pytest.fixture
def small_server():
    """A server whose arena holds exactly 16 chunks of :class:`relkit.Shape` (16 KiB each)."""
    with ServerProcess(l1_size="256KiB", chunk_size=16, transports="cpu_gather") as server:
        yield server


@pytest.fixture
def server():
    with ServerProcess(l1_size="64MiB", chunk_size=64, transports="cpu_gather") as server:
        yield server


@pytest.fixture
def client_of():
    """``client_of(server, **kw)`` -> a CacheClient closed at teardown."""
    made: list[CacheClient] = []

    def make(server: ServerProcess, **kw) -> CacheClient:
        c = CacheClient(server.url, **{"timeout": 20.0, **kw})
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            c.close()
        except Exception:
            pass


@pytest.fixture
def workers():
    """Worker processes started by a test; any left alive are SIGKILLed at teardown."""
    procs: list = []

    def spawn(*args: str):
        p = relkit.spawn_worker(*args)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                f.close()
