"""DeviceOps: which implementation serves which device type, what probe() says, pinning."""

from __future__ import annotations

import pytest
import torch

from kvxfer.transport import cuda_devices
from kvxfer_hpu import DeviceOps, GenericOps, HpuOps, Pinning, ops_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_ops_for_picks_one_implementation_per_device_type() -> None:
    assert isinstance(ops_for("hpu"), HpuOps)
    for t in ("cpu", "cuda", "xpu", "mps"):
        ops = ops_for(t)
        assert type(ops) is GenericOps and ops.device_type == t
    assert ops_for("cuda") is ops_for("cuda")
    for t in ("cpu", "cuda", "hpu"):
        assert isinstance(ops_for(t), DeviceOps)


def test_only_host_memory_is_copied_directly() -> None:
    assert ops_for("cpu").direct
    assert not ops_for("cuda").direct and not ops_for("hpu").direct
    assert not GenericOps("cpu", direct=False).direct


def test_cpu_probe_and_no_pinning() -> None:
    ok, reason = ops_for("cpu").probe()
    assert ok and "host memory" in reason
    pin = GenericOps("cpu").pin(torch.zeros(4096, dtype=torch.uint8))
    assert not pin.pinned and "pageable" in pin.note
    pin.release()
    pin.release()


def test_unknown_device_type_says_why() -> None:
    ok, reason = GenericOps("nosuchdevice").probe()
    assert not ok and "no torch.nosuchdevice module" in reason


def test_probes_agree_with_torch_without_importing_it() -> None:
    """cuda and xpu are probed from torch's build and the CUDA driver (kvxfer plugins lists hpu
    without importing torch); the answer is torch's own."""
    for t in ("cuda", "xpu"):
        ok, reason = ops_for(t).probe()
        assert ok == getattr(torch, t).is_available(), reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_probe_without_a_device() -> None:
    ok, reason = ops_for("cuda").probe()
    assert not ok and reason == cuda_devices()[1] and f"torch {torch.__version__}" in reason
    pin = ops_for("cuda").pin(torch.zeros(4096, dtype=torch.uint8))
    assert not pin.pinned and "cudaHostRegister" in pin.note


@pytest.mark.skipif(HpuOps.installed(), reason="habana_frameworks is installed here")
def test_hpu_probe_without_gaudi_software() -> None:
    ok, reason = ops_for("hpu").probe()
    assert not ok and "habana_frameworks" in reason and "not installed" in reason


def test_hpu_copies_rows_in_the_cache_dtype_generic_in_16_byte_elements() -> None:
    rows = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert ops_for("hpu").copy_dtype([rows]) is torch.bfloat16
    assert ops_for("cuda").copy_dtype([rows]).itemsize == 16
    # rows 24 bytes apart (a padded, interleaved layout): 8-byte elements are the widest that fit
    strided = torch.zeros(64, dtype=torch.bfloat16).as_strided((4, 8), (12, 1))
    assert ops_for("cuda").copy_dtype([rows, strided]) is torch.int64


def test_pinning_release_runs_the_undo_once() -> None:
    calls: list[int] = []
    pin = Pinning(True, "test", lambda: calls.append(1))
    pin.release()
    pin.release()
    assert calls == [1]


@cuda
def test_cuda_pins_host_memory_in_place_and_unpins() -> None:
    host = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not host.is_pinned()
    pin = ops_for("cuda").pin(host)
    try:
        assert pin.pinned, pin.note
        assert host.is_pinned()
        dev = torch.arange(1 << 20, device="cuda").to(torch.uint8)
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host, dev.cpu())
    finally:
        pin.release()
    assert not host.is_pinned()


@cuda
def test_cuda_streams_and_events() -> None:
    ops = ops_for("cuda")
    dev = torch.device("cuda")
    s = ops.new_stream(dev)
    e = ops.new_event()
    assert isinstance(s, torch.cuda.Stream) and isinstance(e, torch.cuda.Event)
    with ops.use_stream(s):
        assert torch.cuda.current_stream(dev) == s
    assert ops.current_stream(dev) == torch.cuda.current_stream(dev)
