"""kvxfer-cuda-ipc: the server-driven transport for KV caches on NVIDIA GPUs.

At registration the engine's process shares each layer's KV tensor with the cache server through
CUDA IPC (handles travel as bytes in :class:`CudaIpcRegistration`, never pickled); the server
opens each allocation once and keeps the mapping until the registration ends. A store or
retrieve request then carries only block ids and the handle of an interprocess CUDA event that
the client recorded on the engine's current stream when it submitted the request; the server
waits on that event on its own streams, and moves the bytes between the engine's blocks and its
arena (registered as pinned host memory) itself:

* store: each chunk's blocks of every layer are gathered on the GPU into a staging buffer by one
  Triton kernel launch (per-layer ``index_select`` without Triton), and the chunk leaves the GPU
  in one DMA copy; gathers and copies run on two streams, so the copy engine is kept busy;
* retrieve: the reverse (one DMA copy per chunk into staging, one scatter launch), honouring
  ``skip_first_n_tokens``.

The server synchronizes its streams before it replies, so a future that completed means the
bytes are in the arena (store) or in the engine's blocks (retrieve); the engine needs no stream
wait. Chunks use the core's arena format, so cpu_gather can load what cuda_ipc stored and back.

The engine's process must outlive the server's use of its tensors: close the transfer context
(which unregisters and makes the server close its IPC mappings) before freeing the KV cache.
"""

from __future__ import annotations

from importlib.metadata import version

from kvxfer_cuda_ipc.transport import (
    CudaIpcContext,
    CudaIpcParams,
    CudaIpcRegistration,
    CudaIpcTensor,
    CudaIpcTransport,
)

__all__ = ["CudaIpcTransport", "CudaIpcContext", "CudaIpcRegistration", "CudaIpcTensor", "CudaIpcParams"]
__version__ = version("kvxfer-cuda-ipc")  # defined once, in pyproject.toml
