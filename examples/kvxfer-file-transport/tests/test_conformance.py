"""The example plugin's tests are the conformance kit."""

from kvxfer.testing import TransportConformance


class TestFileDebug(TransportConformance):
    transport = "file_debug"
    device = "cpu"
