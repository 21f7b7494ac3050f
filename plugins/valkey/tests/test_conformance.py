"""The store conformance kit against a real Valkey node and a real three-node Valkey cluster
(made with ``valkey-cli --cluster create``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxfer.testing import StoreConformance
from kvxfer_valkey import ValkeyCluster, ValkeyServer


class TestValkeyNode(StoreConformance):
    store = "valkey"

    @pytest.fixture(scope="class")
    @classmethod
    def store_url(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        with ValkeyServer(tmp_path_factory.mktemp("valkey-node")) as node:
            yield node.url


class TestValkeyCluster(StoreConformance):
    store = "valkey"

    @pytest.fixture(scope="class")
    @classmethod
    def store_url(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        with ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster")) as cluster:
            yield cluster.url


def test_a_cluster_spreads_keys_over_its_nodes(tmp_path_factory: pytest.TempPathFactory) -> None:
    from kvxfer.store import StoreOptions
    from kvxfer_valkey import ValkeyStore

    with ValkeyCluster(tmp_path_factory.mktemp("spread")) as cluster:
        # any one node is enough to discover the cluster
        backend = ValkeyStore().open(cluster.nodes[1].url, StoreOptions())
        try:
            assert backend.cluster
            keys = [b"kvxfer:c1:spread:%d" % i for i in range(30)]
            backend.submit_put([(k, [memoryview(b"v")]) for k in keys]).result(30)
            counts = [int(n.cli("dbsize").strip()) for n in cluster.nodes]
            assert sum(counts) == 30 and all(c > 0 for c in counts), counts
            assert backend.submit_exists(keys).result(30) == [1] * 30
            stats = backend.stats()  # what a single node's show too: a cluster full and evicting is seen
            assert stats["nodes"] == "3" and stats["keys"] == "30" and stats["evicted"] == "0", stats
            assert stats["maxmemory"] == "none" and stats["policy"] == "noeviction", stats
        finally:
            backend.close()


def test_the_plugin_imports_only_kvxfers_public_api() -> None:
    """``kvxfer``, ``kvxfer.transport`` and, for a store backend, ``kvxfer.store``: what a
    third-party plugin may rely on (``kvxfer.testing.imports``)."""
    from pathlib import Path

    import kvxfer_valkey
    from kvxfer.testing.imports import private_imports

    assert private_imports(Path(kvxfer_valkey.__file__).parent) == []


def test_the_kit_leaves_a_store_given_by_url_as_it_was(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--kvxfer-store-url`` may name a shared Valkey: the kit deletes every key its tests wrote
    (its own, and the chunks its server wrote to L2). It left them all behind (92 a run)."""
    import os
    import subprocess
    import sys

    with ValkeyServer(tmp_path_factory.mktemp("valkey-given")) as node:
        node.cli("set", "kvxfer:theirs", "kept")
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvxfer-store=valkey",
             f"--kvxfer-store-url={node.url}", "--pyargs", "kvxfer.testing.store_suite",
             "-k", "put_then_get or exists_answers_many or delete_removes or round_trip_through_a_server"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path_factory.mktemp("run"), env=dict(os.environ))
        assert out.returncode == 0 and "4 passed" in out.stdout and "warning" not in out.stdout, out.stdout + out.stderr
        assert node.cli("--scan").split() == ["kvxfer:theirs"]
