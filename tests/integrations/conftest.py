"""Fixtures of the vLLM connector tests: one real kvxfer server per module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # kvxfer_vllm_harness (pytest runs in importlib mode)

from kvxfer.testing.server import ServerProcess  # noqa: E402

CHUNK = 16  # tokens per chunk: 4 blocks of 4 tokens


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size="64MiB", chunk_size=CHUNK, transports="cpu_gather") as srv:
        yield srv
