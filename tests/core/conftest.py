"""Fixtures of the core tests: real server processes, real clients, a really installed plugin."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer import CacheClient
from kvxfer.testing.server import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))  # importlib mode: make the helpers importable
from kvxfer_core_helpers import CHUNK_SIZE  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TEST_PLUGIN_SRC = FIXTURES / "kvxfer-test-transport"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One real ``kvxfer serve`` per test module (start-up costs ~2 s)."""
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather") as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[CacheClient]:
    c = CacheClient(server.url, timeout=15, connect_timeout=10, name="tests/core")
    yield c
    c.close()


@pytest.fixture(scope="session")
def test_plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests/fixtures/kvxfer-test-transport`` really installed (pip, with its dist-info and
    entry points) into a private directory; put it on PYTHONPATH to make its plugins visible."""
    work = tmp_path_factory.mktemp("test-plugin")
    src = work / "src"
    shutil.copytree(TEST_PLUGIN_SRC, src)  # keep build/ and egg-info out of the checkout
    target = work / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"installing the test plugin failed:\n{proc.stdout}\n{proc.stderr}"
    assert list(target.glob("kvxfer_test_transport-*.dist-info")), "pip left no dist-info"
    return target
