"""cuda_ipc's registration and params, as the server decodes them from the wire: fields of the
sizes real ones have are taken; a small field past its bound is refused as it is decoded (the
server keeps a registration's strings for its life, and echoes some in errors). Runs without a
GPU: it decodes bytes only, as the server does before it opens anything (the handles' headers
included)."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest

from kvxfer.errors import ConfigError
from kvxfer.transport import MAX_LAYERS
from kvxfer_cuda_ipc.server import _expandable_pages
from kvxfer_cuda_ipc.transport import MAX_SMALL_FIELD, CudaIpcParams, CudaIpcRegistration

# what an engine on an H100 sends (the handles' sizes as CUDA and torch make them)
TENSOR: dict[str, Any] = {
    "handle": b"\x01" * 64, "storage_size_bytes": 1 << 30, "storage_offset_bytes": 0,
    "ref_counter_handle": b"/torch_123456_2899571853_0", "ref_counter_offset": 3,
    "event_handle": b"\x02" * 64, "event_sync_required": True, "storage_offset": 0,
    "shape": [2, 1024, 16, 8, 128], "stride": [16777216, 16384, 1024, 128, 1], "dtype": "bfloat16",
    "device_uuid": "4a1c9a1e-6b0f-3c11-2d8e-0b5e7f9c2a13",
}
REGISTRATION: dict[str, Any] = {
    "instance_id": 7, "model_name": "m", "world_size": 1, "rank": 0, "layout": "flash_attn", "num_layers": 1,
    "num_blocks": 1024, "block_size": 16, "hidden_dim_size": 1024, "dtype": "bfloat16", "use_mla": False,
    "pid": 4242, "device_name": "cuda:0 NVIDIA H100 80GB HBM3", "tensors": [TENSOR],
}


def _decode(fields: dict[str, Any], type_: type) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=type_)


def test_a_real_sized_registration_and_params_decode() -> None:
    reg = _decode(REGISTRATION, CudaIpcRegistration)
    assert reg.tensors[0].device_uuid == TENSOR["device_uuid"] and reg.device_name == REGISTRATION["device_name"]
    params = _decode({"event_handle": b"\x03" * 64, "done_event": b"\x04" * 64}, CudaIpcParams)
    assert len(params.done_event) == 64
    at_bound = dict(REGISTRATION, device_name="x" * MAX_SMALL_FIELD)
    assert len(_decode(at_bound, CudaIpcRegistration).device_name) == MAX_SMALL_FIELD


@pytest.mark.parametrize("field", ["ref_counter_handle", "event_handle", "dtype", "device_uuid"])
def test_a_tensor_field_past_its_bound_is_refused(field: str) -> None:
    long = b"x" * (MAX_SMALL_FIELD + 1) if isinstance(TENSOR[field], bytes) else "x" * (MAX_SMALL_FIELD + 1)
    with pytest.raises(msgspec.ValidationError, match=f"tensors\\[0\\].{field}"):
        _decode(dict(REGISTRATION, tensors=[dict(TENSOR, **{field: long})]), CudaIpcRegistration)


def test_a_device_name_or_event_past_its_bound_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="device_name"):
        _decode(dict(REGISTRATION, device_name="x" * (1 << 20)), CudaIpcRegistration)
    for field in ("event_handle", "done_event"):
        with pytest.raises(msgspec.ValidationError, match=field):
            _decode({field: b"x" * (MAX_SMALL_FIELD + 1)}, CudaIpcParams)


def test_more_layers_than_kvxfer_takes_are_refused_as_they_are_decoded() -> None:
    """A registration names at most MAX_LAYERS layers, in ``num_layers`` and in ``tensors``:
    8 MiB of minimal tensors (about 39,000) took 0.15 s of the server's loop to decode, and the
    server keeps a table entry per layer."""
    at_bound = dict(REGISTRATION, num_layers=MAX_LAYERS, tensors=[TENSOR] * MAX_LAYERS)
    assert len(_decode(at_bound, CudaIpcRegistration).tensors) == MAX_LAYERS
    with pytest.raises(msgspec.ValidationError, match="tensors"):
        _decode(dict(REGISTRATION, tensors=[TENSOR] * (MAX_LAYERS + 1)), CudaIpcRegistration)
    with pytest.raises(msgspec.ValidationError, match="num_layers"):
        _decode(dict(REGISTRATION, num_layers=MAX_LAYERS + 1), CudaIpcRegistration)


@pytest.mark.parametrize("field", ["storage_size_bytes", "storage_offset_bytes"])
def test_a_negative_storage_size_or_offset_is_refused_as_it_is_decoded(field: str) -> None:
    """torch opens a handle at the allocation's start plus the offset, and takes the size as
    given: a negative offset would place the storage before the allocation (the server checks
    the rest of the claim against the allocation once it is open)."""
    with pytest.raises(msgspec.ValidationError, match=f"tensors\\[0\\].{field}"):
        _decode(dict(REGISTRATION, tensors=[dict(TENSOR, **{field: -1})]), CudaIpcRegistration)


def _expandable(pid: int, page: int, pages: int, per_page: int = 4) -> bytes:
    """A handle as torch makes one for an expandable segment: its format version, ``e``, the
    header, then a descriptor (or a fabric handle) per page."""
    return bytes([2]) + b"e" + struct.pack("@iQQ", pid, page, pages) + b"\x07" * (per_page * pages)


def test_what_an_expandable_segments_handle_names_is_read_as_torch_reads_it() -> None:
    """The server learns from an expandable segment's handle which process it names (torch takes
    the page descriptors from that process as it opens the handle) and how many pages it maps;
    a handle of 64 bytes is a cudaIpcMemHandle_t whatever its bytes (torch opens it as one),
    and a ``c`` handle a cudaMalloc allocation's."""
    assert _expandable_pages(_expandable(4242, 20 << 20, 3)) == (4242, 20 << 20, 3)
    assert _expandable_pages(_expandable(4242, 2 << 20, 2, per_page=64)) == (4242, 2 << 20, 2)  # fabric handles
    assert _expandable_pages(bytes([2]) + b"e" + b"\x00" * 62) is None  # 64 bytes: raw
    assert _expandable_pages(bytes([2]) + b"c" + b"\x00" * 64) is None
    for bad in (_expandable(4242, 20 << 20, 3)[:-1], _expandable(4242, 0, 1), _expandable(4242, 20 << 20, 0),
                bytes([2]) + b"e" + b"\x00" * 10):
        with pytest.raises(ConfigError, match="expandable segment's handle"):
            _expandable_pages(bad)
