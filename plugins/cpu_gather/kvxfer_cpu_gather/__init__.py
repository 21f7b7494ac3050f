"""kvxfer-cpu-gather: the client-driven transport for KV caches in host memory (or any device).

Registration carries only scalars (:class:`CpuGatherRegistration`). To store, the engine's
process copies each chunk's rows of every layer straight into the chunk's reserved slot of the
server's shared-memory arena; to retrieve, from the slot into the blocks. One copy each way, no
intermediate buffer. Host tensors are copied by the core's C row copy
(:class:`kvxfer.transport.HostRows`: one call per chunk, without the GIL, with streaming
stores), which gathers rows faster than torch's own memcpy moves the same bytes.

KV tensors on another device (CUDA, XPU, HPU...) are served too: each layer's rows are gathered
on the device, then copied to the slot by that device's own copy.
"""

from __future__ import annotations

from importlib.metadata import version

from kvxfer_cpu_gather.transport import CpuGatherContext, CpuGatherRegistration, CpuGatherTransport

__all__ = ["CpuGatherTransport", "CpuGatherContext", "CpuGatherRegistration"]
__version__ = version("kvxfer-cpu-gather")  # defined once, in pyproject.toml
