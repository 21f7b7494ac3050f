"""What the conformance kit does not cover: which transport "auto" picks, probe() contents,
pinning of the arena mapping, and (on CUDA) ordering after the engine's stream."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import torch

from kvxfer import CacheClient, ConfigError, KVLayout, TransportError, TransportUnavailable
from kvxfer.testing import ServerProcess
from kvxfer.transport import InstanceIdentity, get_transport, select
from kvxfer_hpu import GenericOps, HpuContext, HpuTransport

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHUNK = 32
BLOCK = 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size="64MiB", chunk_size=CHUNK, transports="hpu,cpu_gather") as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[CacheClient]:
    c = CacheClient(server.url)
    yield c
    c.close()


def _kv(device: str, layers: int = 2, blocks: int = 16) -> list[torch.Tensor]:
    return [torch.randn(2, blocks, BLOCK, 2, 16, device=device).to(torch.bfloat16) for _ in range(layers)]


def _keys(n: int) -> list[bytes]:
    return [secrets.token_bytes(16) for _ in range(n)]


def test_auto_keeps_cpu_gather_for_cpu_tensors(client: CacheClient) -> None:
    ctx = client.register(_kv("cpu"), model_name="auto-cpu", block_size=BLOCK, transport="auto")
    try:
        assert ctx.transport_name == "cpu_gather"
    finally:
        ctx.close()
    assert select("auto", torch.device("cpu")).name == "cpu_gather"


def test_named_hpu_serves_cpu_tensors(client: CacheClient) -> None:
    ctx = client.register(_kv("cpu"), model_name="named-cpu", block_size=BLOCK, transport="hpu")
    try:
        assert isinstance(ctx, HpuContext) and ctx.ops.direct
    finally:
        ctx.close()


def test_priorities_rank_hpu_first_only_for_hpu() -> None:
    hpu = get_transport("hpu")
    fallback = get_transport("cpu_gather")
    assert hpu.priority_for(torch.device("hpu")) > fallback.priority_for(torch.device("hpu"))
    assert hpu.priority_for(torch.device("cpu")) < fallback.priority_for(torch.device("cpu"))
    cuda_dev = torch.device("cuda")
    assert fallback.priority_for(cuda_dev) < hpu.priority_for(cuda_dev)
    try:  # the transport made for CUDA, when installed, outranks hpu on cuda tensors
        ipc = get_transport("cuda_ipc", require_available=False)
    except TransportError:
        return
    assert ipc.priority_for(cuda_dev) > hpu.priority_for(cuda_dev)


def test_probe_lists_served_device_types_and_why_not_the_others() -> None:
    """One line: Intel Gaudi first (found, or what is missing), then what else is served and
    why each other device type is not."""
    probe = HpuTransport().probe()
    assert probe.available and "cpu" in probe.device_types and "\n" not in probe.reason
    gaudi = "hpu" in probe.device_types
    assert probe.reason.startswith("Intel Gaudi: " if gaudi else "no Intel Gaudi: "), probe.reason
    assert ("; also serves cpu (" if gaudi else "; serves cpu (") in probe.reason, probe.reason
    for t in ("cuda", "xpu"):
        if t in probe.device_types:
            assert f", {t} (" in probe.reason, probe.reason
        else:
            assert f"; not {t}: " in probe.reason, probe.reason
    assert "not hpu" not in probe.reason, probe.reason


def test_transport_refuses_tensors_on_an_unavailable_device(client: CacheClient) -> None:
    layers = _kv("meta")
    layout = KVLayout("flash_attn", 2, 16, BLOCK, 32, torch.bfloat16)
    with pytest.raises(TransportUnavailable, match="cannot move KV tensors on meta"):
        HpuTransport().client_context(client, layers, layout, InstanceIdentity(1, "m", 1, 0))



def test_ops_of_another_device_type_are_refused(client: CacheClient) -> None:
    layers = _kv("cpu")
    layout = KVLayout.infer(layers, BLOCK)
    with pytest.raises(ConfigError, match="device ops for 'cuda'"):
        HpuContext(HpuTransport(), client, layers, layout, InstanceIdentity(2, "m", 1, 0), ops=GenericOps("cuda"))


@pytest.mark.parametrize("group_chunks", [1, 2, 5])
def test_staging_path_over_several_groups_and_requests(client: CacheClient, group_chunks: int) -> None:
    """Requests of 5 chunks through a gather buffer of 1, 2 or 5 chunks and two chunk buffers,
    retrieves with a skip that splits a chunk into per-plane copies: bit-exact every time."""
    layers = _kv("cpu", layers=3, blocks=40)
    layout = KVLayout.infer(layers, BLOCK)
    ctx = HpuContext(HpuTransport(), client, layers, layout, InstanceIdentity(secrets.randbits(60) + 1, "groups", 1, 0),
                     ops=GenericOps("cpu", direct=False))
    ctx.GROUP_BYTES = group_chunks * layout.chunk_bytes(CHUNK)  # type: ignore[misc]
    ctx.register()
    try:
        bpc = CHUNK // BLOCK
        for skip_blocks in (0, 3, 4):
            keys = _keys(5)
            src = torch.randperm(20)[: 5 * bpc].tolist()
            assert ctx.submit_store(keys, src).result(30).stored == [0, 1, 2, 3, 4]
            dst = (torch.randperm(20)[: 5 * bpc] + 20).tolist()
            before = [t.clone() for t in layers]
            res = ctx.submit_retrieve(keys, dst, skip_first_n_tokens=skip_blocks * BLOCK).result(30)
            assert res.loaded == [0, 1, 2, 3, 4]
            for t, old in zip(layers, before):
                loaded, kept = dst[skip_blocks:], dst[:skip_blocks]
                assert torch.equal(t[:, loaded].view(torch.int16), t[:, src[skip_blocks:]].view(torch.int16))
                assert torch.equal(t[:, kept].view(torch.int16), old[:, kept].view(torch.int16))
        assert ctx._pipe is not None and len(ctx._pipe.chunks) == HpuContext.STAGING_DEPTH
        assert ctx._pipe.group_rows == group_chunks * 2 * bpc
    finally:
        ctx.close()


@cuda
def test_cuda_arena_mapping_is_pinned_and_registration_says_so(client: CacheClient) -> None:
    ctx = client.register(_kv("cuda"), model_name="pin", block_size=BLOCK, transport="hpu")
    try:
        assert isinstance(ctx, HpuContext)
        assert ctx.pinning.pinned, ctx.pinning.note
        assert ctx.arena.tensor.is_pinned()
        assert ctx.registration().host_pinned and ctx.registration().device == "cuda"
    finally:
        ctx.close()
    assert ctx.pinning._undo is None


@cuda
def test_cuda_store_waits_for_work_queued_on_the_callers_stream(client: CacheClient) -> None:
    """The engine writes its KV on its own stream behind a long kernel and stores without
    synchronizing: the stored chunk must hold what the engine wrote, not what was there."""
    layers = [torch.zeros(2, 16, BLOCK, 2, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ctx = client.register(layers, model_name="order", block_size=BLOCK, transport="hpu")
    try:
        keys = _keys(1)
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write lands
            for t in layers:
                t[:, 0:2] = 7.0  # (a slice: a list index is copied to the device with a wait for the stream)
            future = ctx.submit_store(keys, [0, 1])
        assert future.result(30).stored == [0]
        torch.cuda.synchronize()
        assert ctx.submit_retrieve(keys, [4, 5]).result(30).loaded == [0]
        for t in layers:
            assert bool((t[:, [4, 5]] == 7.0).all())
    finally:
        ctx.close()


@cuda
def test_cuda_retrieve_writes_after_work_queued_on_the_callers_stream(client: CacheClient) -> None:
    """The engine queues a write of blocks behind a long kernel on its stream, then loads into
    them without synchronizing: the load lands after that write (the retrieve's scatter once ran
    at once on its own stream, and the engine's late write then replaced the loaded bytes)."""
    layers = [torch.zeros(2, 16, BLOCK, 2, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ctx = client.register(layers, model_name="order-load", block_size=BLOCK, transport="hpu")
    try:
        keys = _keys(1)
        for t in layers:
            t[:, [0, 1]] = 7.0
        assert ctx.submit_store(keys, [0, 1]).result(30).stored == [0]
        torch.cuda.synchronize()
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the engine's write lands
            for t in layers:
                t[:, 4:6] = -1.0  # (a slice: a list index is copied to the device with a wait for the stream)
            future = ctx.submit_retrieve(keys, [4, 5])
        assert future.result(30).loaded == [0]
        torch.cuda.synchronize()
        for t in layers:
            assert bool((t[:, [4, 5]] == 7.0).all()), "the engine's earlier write landed over the loaded blocks"
    finally:
        ctx.close()


def _staged_context(client: CacheClient, layers: list[torch.Tensor], name: str) -> HpuContext:
    layout = KVLayout.infer(layers, BLOCK)
    ctx = HpuContext(HpuTransport(), client, layers, layout, InstanceIdentity(secrets.randbits(60) + 1, name, 1, 0),
                     ops=GenericOps("cpu", direct=False))
    ctx.register()
    return ctx


def test_layerwise_transfers_through_the_staging_path(client: CacheClient) -> None:
    """One range of layers per gather/scatter call through the staging buffers: a layer-wise
    retrieve lands every layer bit-exact (with a skip that cuts a chunk into planes), a layer-wise
    store copies each layer as written when it was declared ready."""
    layers = _kv("cpu", layers=4, blocks=40)
    ctx = _staged_context(client, layers, "layerwise")
    try:
        bpc = CHUNK // BLOCK
        keys = _keys(3)
        src = list(range(3 * bpc))
        fut = ctx.submit_store(keys, src, by_layer=True)
        for i, t in enumerate(layers):
            t[:, src] = t[:, src] * 3 + 1  # written by "the forward pass" before it is declared
            fut.layer_ready(i)
        assert fut.result(30).stored == [0, 1, 2]
        dst = list(range(20, 20 + 3 * bpc))
        back = ctx.submit_retrieve(keys, dst, skip_first_n_tokens=BLOCK, by_layer=True)
        for i, t in enumerate(layers):
            back.wait_layer(i, timeout=30)
            assert torch.equal(t[:, dst[1:]].view(torch.int16), t[:, src[1:]].view(torch.int16)), i
        assert back.result(30).loaded == [0, 1, 2]
    finally:
        ctx.close()


@cuda
def test_cuda_layerwise_store_waits_for_each_layer_on_the_callers_stream(client: CacheClient) -> None:
    """Each layer is written on the engine's stream behind a long kernel and declared ready at
    once, without synchronizing: every stored layer holds what the engine wrote; a layer-wise
    retrieve lands each layer before wait_layer returns."""
    layers = [torch.zeros(2, 16, BLOCK, 2, 16, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ctx = client.register(layers, model_name="lw-order", block_size=BLOCK, transport="hpu")
    try:
        keys = _keys(1)
        engine = torch.cuda.Stream()
        fut = ctx.submit_store(keys, [0, 1], by_layer=True)
        with torch.cuda.stream(engine):
            for i, t in enumerate(layers):
                torch.cuda._sleep(50_000_000)
                t[:, [0, 1]] = float(i + 1)
                fut.layer_ready(i)
        assert fut.result(30).stored == [0]
        torch.cuda.synchronize()
        back = ctx.submit_retrieve(keys, [4, 5], by_layer=True)
        for i, t in enumerate(layers):
            back.wait_layer(i, timeout=30)
            assert bool((t[:, [4, 5]] == float(i + 1)).all()), i
        back.result(30)
    finally:
        ctx.close()


def _plugin_figures(client: CacheClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in client.status().plugin_metrics}


def test_copy_time_and_staging_reach_the_servers_figures(client: CacheClient) -> None:
    """The staging path on cpu: each commit carries the client's copy time, the registration its
    staging; the server's hpu hooks turn them into figures (status and /metrics)."""
    layers = _kv("cpu", layers=2, blocks=16)
    layout = KVLayout.infer(layers, BLOCK)
    before = _plugin_figures(client)
    ctx = HpuContext(HpuTransport(), client, layers, layout, InstanceIdentity(secrets.randbits(60) + 1, "figures", 1, 0),
                     ops=GenericOps("cpu", direct=False))
    ctx.register()
    try:
        keys = _keys(2)
        assert ctx.submit_store(keys, list(range(4))).result(30).stored == [0, 1]
        assert ctx.submit_retrieve(keys, list(range(8, 12))).result(30).loaded == [0, 1]
        after = _plugin_figures(client)
        chunk = layout.chunk_bytes(CHUNK)
        for op in ("store", "retrieve"):
            labels = (("device", "cpu"), ("op", op))
            assert after[("kvxfer_hpu_copies_total", labels)] - before.get(("kvxfer_hpu_copies_total", labels), 0) == 1
            assert after[("kvxfer_hpu_copied_bytes_total", labels)] - before.get(
                ("kvxfer_hpu_copied_bytes_total", labels), 0) == 2 * chunk
            assert after[("kvxfer_hpu_copy_seconds_total", labels)] > before.get(
                ("kvxfer_hpu_copy_seconds_total", labels), 0.0)
        assert ctx.staging_bytes() == (max(1, HpuContext.GROUP_BYTES // chunk) + HpuContext.STAGING_DEPTH) * chunk
        assert after[("kvxfer_hpu_staging_bytes", (("device", "cpu"),))] == ctx.staging_bytes()
        assert after[("kvxfer_hpu_contexts", (("device", "cpu"), ("pinned", "false")))] == 1
        (traffic,) = [t for t in client.status().traffic if t.model == "figures"]
        assert traffic.store_copy_s > 0 and traffic.transport == "hpu"
    finally:
        ctx.close()
    gone = _plugin_figures(client)
    assert ("kvxfer_hpu_staging_bytes", (("device", "cpu"),)) not in gone  # the context closed


def test_a_registration_declaring_nonsense_staging_is_refused(client: CacheClient) -> None:
    import msgspec

    from kvxfer.errors import InvalidRequest
    from kvxfer.protocol import codec
    from kvxfer.protocol import messages as m
    from kvxfer_hpu import HpuRegistration

    reg = HpuRegistration(instance_id=secrets.randbits(60) + 1, model_name="bad", world_size=1, rank=0,
                          layout="flash_attn", num_layers=2, num_blocks=16, block_size=BLOCK, hidden_dim_size=32,
                          dtype="bfloat16", use_mla=False, device="cpu", staging_bytes=-1)
    with pytest.raises(InvalidRequest, match="staging_bytes"):
        client.request(m.Register("hpu", msgspec.Raw(codec.encode(reg))))
    bad_device = msgspec.structs.replace(reg, staging_bytes=0, device="../etc")
    with pytest.raises(InvalidRequest, match="device"):
        client.request(m.Register("hpu", msgspec.Raw(codec.encode(bad_device))))


@cuda
def test_cuda_contexts_report_pinned_staging_to_the_server(client: CacheClient) -> None:
    ctx = client.register(_kv("cuda", layers=2, blocks=16), model_name="figures-cuda", block_size=BLOCK,
                          transport="hpu")
    try:
        assert isinstance(ctx, HpuContext) and not ctx.ops.direct
        keys = _keys(2)
        assert ctx.submit_store(keys, list(range(4))).result(30).stored == [0, 1]
        assert ctx.submit_retrieve(keys, list(range(8, 12))).result(30).loaded == [0, 1]
        figures = _plugin_figures(client)
        assert figures[("kvxfer_hpu_staging_bytes", (("device", "cuda"),))] == ctx.staging_bytes() > 0
        assert figures[("kvxfer_hpu_contexts", (("device", "cuda"), ("pinned", "true")))] == 1
        assert figures[("kvxfer_hpu_copy_seconds_total", (("device", "cuda"), ("op", "store")))] > 0
    finally:
        ctx.close()


def test_figures_keep_a_bounded_number_of_device_types(client: CacheClient) -> None:
    """A registration names its device type, and a client may name any: one that cycled through
    new names (register, store, unregister) once grew hpu's figures by three samples a name, for
    ever, until the server's cut at 512 samples dropped the open registrations' gauges. Now at
    most MAX_DEVICE_LABELS types are kept by name; an idle one makes room (its totals go on under
    ``_other``), and where all are in use a new type's figures go to ``_other`` from the start."""
    import msgspec

    from kvxfer.protocol import codec
    from kvxfer.protocol import messages as m
    from kvxfer_hpu import HpuRegistration
    from kvxfer_hpu.server import MAX_DEVICE_LABELS, OTHER_DEVICE

    base = HpuRegistration(instance_id=0, model_name="labels", world_size=1, rank=0, layout="flash_attn",
                           num_layers=2, num_blocks=16, block_size=BLOCK, hidden_dim_size=32, dtype="bfloat16",
                           use_mla=False, device="cpu")
    first = secrets.randbits(50) + 1

    def register(j: int, device: str) -> int:
        reg = msgspec.structs.replace(base, instance_id=first + j, device=device)
        client.request(m.Register("hpu", msgspec.Raw(codec.encode(reg))))
        return first + j

    def store(iid: int) -> None:
        reserved = client.request(m.ReserveWrite(iid, [b"\x01" * 16]))
        client.request(m.CommitWrite(iid, reserved.reservation_id, copy_s=0.001))

    def stores(figures: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
        return sum(v for (name, labels), v in figures.items()
                   if name == "kvxfer_hpu_copies_total" and ("op", "store") in labels)

    before = _plugin_figures(client)
    live = register(0, "cpu")  # stays open throughout
    cycled = 3 * MAX_DEVICE_LABELS
    for j in range(1, cycled + 1):
        iid = register(j, f"dev{j}")
        store(iid)
        client.request(m.Unregister(iid))
    figures = _plugin_figures(client)
    devices = {dict(labels)["device"] for name, labels in figures if name == "kvxfer_hpu_copies_total"}
    assert len(devices - {OTHER_DEVICE}) <= MAX_DEVICE_LABELS and OTHER_DEVICE in devices, devices
    assert stores(figures) - stores(before) == cycled  # no store lost from the sums
    assert figures[("kvxfer_hpu_contexts", (("device", "cpu"), ("pinned", "false")))] >= 1
    (hpu,) = [t for t in client.status().transports if t.name == "hpu"]
    assert len(hpu.state) <= (MAX_DEVICE_LABELS + 1) * 2 * 3, len(hpu.state)
    # every kept type in use: a new one is counted as _other, and the kept ones keep their names
    held = [register(cycled + j, f"held{j}") for j in range(1, MAX_DEVICE_LABELS + 1)]
    try:
        extra = register(cycled + MAX_DEVICE_LABELS + 1, "onemore")
        store(extra)
        figures = _plugin_figures(client)
        assert ("kvxfer_hpu_contexts", (("device", OTHER_DEVICE), ("pinned", "false"))) in figures
        assert not any(dict(labels).get("device") == "onemore" for _, labels in figures)
        assert figures[("kvxfer_hpu_contexts", (("device", "cpu"), ("pinned", "false")))] >= 1
        client.request(m.Unregister(extra))
    finally:
        for iid in [*held, live]:
            client.request(m.Unregister(iid))


def test_a_registration_opened_but_refused_by_the_core_is_never_counted() -> None:
    """The core can refuse a registration after hpu's open() (its session ended, or another took
    its id while it opened); nothing then closes it. hpu's open() only checks the registration:
    it counts one from the core's kvxfer_context_registered on, with what the registered
    context's registration declares. In process: no real client can end its session inside the
    server's open() at will, so the registered contexts are stand-ins with the three attributes
    the hook reads (a real server's registrations are counted in the tests above)."""
    from types import SimpleNamespace

    from kvxfer_hpu import HpuRegistration
    from kvxfer_hpu.server import HpuServerTransport

    server = HpuServerTransport(HpuTransport())
    layout = KVLayout.infer(_kv("cpu", layers=2, blocks=16), BLOCK)

    def reg(instance_id: int, device: str) -> HpuRegistration:
        return HpuRegistration(instance_id=instance_id, model_name="refused", world_size=1, rank=0,
                               layout="flash_attn", num_layers=2, num_blocks=16, block_size=BLOCK,
                               hidden_dim_size=32, dtype="bfloat16", use_mla=False, device=device)

    def contexts() -> dict[str, float]:
        return {s.labels["device"]: s.value for s in server.kvxfer_metrics() if s.name == "kvxfer_hpu_contexts"}

    assert server.open(reg(1, "npu"), layout) is None  # opened; the core never registers it
    assert server.open(reg(1, "cpu"), layout) is None  # the same id, opened at the same time
    assert contexts() == {}
    server.kvxfer_context_registered(SimpleNamespace(instance_id=1, transport="hpu", registration=reg(1, "cpu")))
    assert contexts() == {"cpu": 1}  # the one registered, with what it declared
    server.kvxfer_context_registered(SimpleNamespace(instance_id=2, transport="other", registration=reg(2, "npu")))
    assert contexts() == {"cpu": 1}  # another transport's registration is not hpu's to count
    with pytest.raises(ConfigError, match="device must be a torch device type"):
        server.open(reg(3, "Bad-Type"), layout)
