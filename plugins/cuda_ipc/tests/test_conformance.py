"""The transport conformance kit against cuda_ipc, with CUDA KV tensors (skips without CUDA)."""

from kvxfer.testing import TransportConformance


class TestCudaIpc(TransportConformance):
    transport = "cuda_ipc"
    device = "cuda"
