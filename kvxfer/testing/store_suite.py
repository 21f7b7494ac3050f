"""The store conformance suite for any installed store backend, picked on the command line::

    pytest --kvxfer-store=NAME [--kvxfer-store-url=URL] --pyargs kvxfer.testing.store_suite
"""

from kvxfer.testing.stores import StoreConformance


class TestStoreConformance(StoreConformance):
    """``store`` comes from ``--kvxfer-store``; the URL from ``--kvxfer-store-url`` (default: a
    private local instance, when the store can start one)."""
