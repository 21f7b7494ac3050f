"""The kvxfer conformance kit against the hpu transport: KV tensors on cpu here, on cuda on a
GPU machine (a real accelerator standing in for Gaudi; skipped cleanly without one)."""

import pytest

import kvxfer_hpu.transport as hpu_transport
from kvxfer.testing import TransportConformance
from kvxfer.testing.harness import Kit
from kvxfer_hpu import GenericOps, HpuContext, ops_for


class TestHpuOnCpu(TransportConformance):
    transport = "hpu"
    device = "cpu"  # runs in CI here


class TestHpuOnCuda(TransportConformance):
    transport = "hpu"
    device = "cuda"  # skips cleanly without a GPU; runs in scripts/gpu_check.sh on a GPU host


class TestHpuStagingPathOnCpu(TransportConformance):
    """The whole kit through the accelerator data path (device staging buffer, then one copy
    to the slot) with host memory playing the device, so CI covers that path without a GPU."""

    transport = "hpu"
    device = "cpu"

    @pytest.fixture(autouse=True)
    def staged_ops(self, monkeypatch: pytest.MonkeyPatch) -> GenericOps:
        staged = GenericOps("cpu", direct=False)
        monkeypatch.setattr(hpu_transport, "ops_for", lambda t: staged if t == "cpu" else ops_for(t))
        return staged

    def test_contexts_take_the_staging_path(self, kit: Kit, staged_ops: GenericOps) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        assert isinstance(ctx, HpuContext)
        assert ctx.ops is staged_ops and not ctx.ops.direct
