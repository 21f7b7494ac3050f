"""kvxfer-cpu-gather: the client-driven transport for KV caches in host memory (or any device).

Registration carries only scalars (:class:`CpuGatherRegistration`). To store, the engine's
process gathers each chunk's blocks of every layer with one ``index_select`` per layer straight
into the chunk's reserved slot of the server's shared-memory arena; to retrieve, one
``index_put_`` per layer from the slot into the blocks. One copy each way, no intermediate
buffer, rows moved as 16-byte elements (the fast path of torch's indexing kernels).

KV tensors on another device (CUDA, XPU, HPU...) are served too: each layer's rows are gathered
on the device, then copied to the slot by that device's own copy.
"""

from __future__ import annotations

from importlib.metadata import version

from kvxfer_cpu_gather.transport import CpuGatherContext, CpuGatherRegistration, CpuGatherTransport

__all__ = ["CpuGatherTransport", "CpuGatherContext", "CpuGatherRegistration"]
__version__ = version("kvxfer-cpu-gather")  # defined once, in pyproject.toml
