"""cpu_gather runs the whole conformance kit (on CPU tensors)."""

from kvxfer.testing import TransportConformance


class TestCpuGather(TransportConformance):
    transport = "cpu_gather"
    device = "cpu"
