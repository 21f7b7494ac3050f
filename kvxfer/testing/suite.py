"""The conformance suite for any installed transport, picked on the command line::

    pytest --kvxfer-transport=NAME [--kvxfer-device=cuda] --pyargs kvxfer.testing.suite
"""

from kvxfer.testing.conformance import TransportConformance


class TestConformance(TransportConformance):
    """``transport`` and ``device`` come from ``--kvxfer-transport`` / ``--kvxfer-device``."""
