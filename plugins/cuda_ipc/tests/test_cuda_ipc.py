"""cuda_ipc tests the conformance kit does not cover.

On a host without CUDA: the probe's reason, and registration failing at once with it. With
CUDA (scripts/gpu_check.sh on a GPU host): the staging ring wrapping around (many chunks, small staging),
realistic chunk sizes across the two transports, the engine-stream ordering of stores, the
refusal of a GPU the server cannot see, of a done_event that does not open (without waiting for
the device), of reference counters that are not torch's, of a storage claimed past the
allocation its handle opens (PyTorch's expandable segments included), and of a
declared KV cache larger than any GPU; no kernel compiled after a context's first store and
retrieve; each copy path (Triton through staging, torch ops, direct) with requests in flight.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator

import msgspec
import pytest
import torch

from kvxfer import CacheClient, KVLayout, RemoteError, TransportUnavailable, chunk_hashes
from kvxfer.testing import ServerProcess
from kvxfer.testing.kvdata import KVSpec, as_bytes, get_chunks, make_kv
from kvxfer.transport import InstanceIdentity, LayoutKind, Registration, get_transport
from kvxfer_cuda_ipc import CudaIpcParams, CudaIpcRegistration, CudaIpcTensor, CudaIpcTransport, _driver

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU (run plugins/cuda_ipc/scripts/gpu_check.sh)")
without_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour of a host without CUDA")


# --------------------------------------------------------------------------- any host


def test_entry_point_loads_the_transport() -> None:
    t = get_transport("cuda_ipc", require_available=False)
    assert isinstance(t, CudaIpcTransport)
    assert t.name == "cuda_ipc" and t.registration_type is CudaIpcRegistration


def test_registration_is_plain_msgpack_and_decodes_as_the_core_base() -> None:
    tensor = CudaIpcTensor(
        handle=bytes(range(64)), storage_size_bytes=1 << 20, storage_offset_bytes=512,
        ref_counter_handle=b"/torch_1_2_3", ref_counter_offset=7, event_handle=b"\x01" * 64,
        event_sync_required=True, storage_offset=3, shape=[2, 4, 16, 2, 8], stride=[1024, 256, 16, 8, 1],
        dtype="bfloat16", device_uuid="GPU-00000000-0000-0000-0000-000000000000")
    reg = CudaIpcRegistration(
        instance_id=5, model_name="m", world_size=1, rank=0, layout="flash_attn", num_layers=1,
        num_blocks=4, block_size=16, hidden_dim_size=16, dtype="bfloat16", use_mla=False,
        pid=123, device_name="cuda:0 X", tensors=[tensor])
    wire = msgspec.msgpack.encode(reg)
    assert msgspec.msgpack.decode(wire, type=CudaIpcRegistration) == reg
    base = msgspec.msgpack.decode(wire, type=Registration)  # what a server without the plugin sees
    assert (base.instance_id, base.num_blocks) == (5, 4)
    params = CudaIpcParams(event_handle=b"\x02" * 64)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=CudaIpcParams) == params


@without_cuda
def test_probe_says_why_it_is_unavailable() -> None:
    probe = CudaIpcTransport().probe()
    assert not probe.available
    assert "GPU" in probe.reason and "CUDA" in probe.reason


@without_cuda
def test_registering_through_it_fails_at_once_with_the_probe_reason() -> None:
    reason = CudaIpcTransport().probe().reason
    with ServerProcess(l1_size="16MiB", transports="cpu_gather") as server:
        client = CacheClient(server.url)
        try:
            layers = [torch.zeros(2, 4, 16, 2, 8) for _ in range(2)]
            with pytest.raises(TransportUnavailable, match="cuda_ipc") as info:
                client.register(layers, model_name="m", block_size=16, transport="cuda_ipc")
            assert reason in str(info.value)
            assert client.status().contexts == []
        finally:
            client.close()


# --------------------------------------------------------------------------- CUDA


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    if not HAS_CUDA:
        pytest.skip("needs an NVIDIA GPU")
    # 1 MiB of staging gives the smallest ring (2 buffers): requests of many chunks wrap around it.
    with ServerProcess(l1_size="1GiB", chunk_size=256, transports="cuda_ipc,cpu_gather",
                       env={"KVXFER_CUDA_IPC_STAGING_MIB": "1"}) as s:
        yield s


def _keys(n: int) -> list[bytes]:
    return chunk_hashes(list(range(n * 256)), chunk_size=256, salt=secrets.token_bytes(8))


SPEC = KVSpec(LayoutKind.FLASH_ATTN, "bfloat16", num_layers=4, num_blocks=256, block_size=16, heads=8, head_size=128)


@needs_cuda
@pytest.mark.parametrize("kind", [LayoutKind.FLASH_ATTN, LayoutKind.FLASHINFER, LayoutKind.MLA])
def test_many_chunks_wrap_the_staging_ring_both_ways(server: ServerProcess, kind: LayoutKind) -> None:
    spec = KVSpec(kind, "bfloat16", num_layers=4, num_blocks=256, block_size=16, heads=8, head_size=128)
    n = 9  # more chunks than staging buffers, and not a multiple of their number
    client = CacheClient(server.url)
    try:
        src = make_kv(spec, "cuda", seed=1)
        dst = [torch.zeros_like(t) for t in src]
        a = client.register(src, model_name=f"ring-{kind.value}", block_size=16, transport="cuda_ipc")
        b = client.register(dst, model_name=f"ring-{kind.value}", block_size=16, transport="cuda_ipc")
        keys = _keys(n)
        gen = torch.Generator().manual_seed(2)
        src_blocks = torch.randperm(spec.num_blocks, generator=gen)[:n * 16].tolist()
        dst_blocks = torch.randperm(spec.num_blocks, generator=gen)[:n * 16].tolist()
        assert a.submit_store(keys, src_blocks).result(60).stored == list(range(n))
        res = b.submit_retrieve(keys, dst_blocks, skip_first_n_tokens=48).result(60)
        assert res.loaded == list(range(n))
        want = get_chunks(as_bytes([t.cpu() for t in src]), spec, src_blocks[3:], 1)
        got = get_chunks(as_bytes([t.cpu() for t in dst]), spec, dst_blocks[3:], 1)
        assert torch.equal(got, want)
        untouched = get_chunks(as_bytes([t.cpu() for t in dst]), spec, dst_blocks[:3], 1)
        assert not untouched.any(), "skipped blocks were written"
    finally:
        client.close()


@needs_cuda
def test_full_size_chunks_cross_transports_both_ways(server: ServerProcess) -> None:
    spec = SPEC
    client = CacheClient(server.url)
    try:
        src = make_kv(spec, "cuda", seed=3)
        ipc_src = client.register(src, model_name="cross", block_size=16, transport="cuda_ipc")
        ref_src = client.register(src, model_name="cross", block_size=16, transport="cpu_gather")
        out_ref, out_ipc = [torch.zeros_like(t) for t in src], [torch.zeros_like(t) for t in src]
        ref_dst = client.register(out_ref, model_name="cross", block_size=16, transport="cpu_gather")
        ipc_dst = client.register(out_ipc, model_name="cross", block_size=16, transport="cuda_ipc")
        keys = _keys(4)
        blocks = list(range(64, 128))
        assert ipc_src.submit_store(keys[:2], blocks[:32]).result(60).stored == [0, 1]
        assert ref_src.submit_store(keys[2:], blocks[32:]).result(60).stored == [0, 1]
        assert ref_dst.submit_retrieve(keys[:2], blocks[:32]).result(60).ok   # cuda_ipc -> cpu_gather
        assert ipc_dst.submit_retrieve(keys[2:], blocks[32:]).result(60).ok   # cpu_gather -> cuda_ipc
        for layer, a, b in zip(as_bytes(src), as_bytes(out_ref), as_bytes(out_ipc)):  # bytes: NaN != NaN
            assert torch.equal(layer[:, 64:96], a[:, 64:96])
            assert torch.equal(layer[:, 96:128], b[:, 96:128])
            assert not a[:, 96:128].any() and not b[:, 64:96].any()
    finally:
        client.close()


@needs_cuda
@pytest.mark.parametrize("env", [{}, {"KVXFER_CUDA_IPC_KERNEL": "torch"}, {"KVXFER_CUDA_IPC_MODE": "direct"}],
                         ids=["triton-staged", "torch-ops", "direct"])
def test_every_copy_path_moves_the_rows_of_each_request_in_flight(env: dict[str, str]) -> None:
    """Each copy path (the Triton kernels through staging, the per-layer torch ops, the kernels
    straight into the mapped arena) with six stores, then six retrieves (some cut by a skip),
    all in flight at once, each naming other blocks: a request's row ids, uploaded through one
    pinned buffer the next request rewrites, stay its own until its copies have read them, so
    each chunk lands where its request said and nowhere else."""
    spec = SPEC
    with ServerProcess(l1_size="256MiB", chunk_size=256, transports="cuda_ipc",
                       env={"KVXFER_CUDA_IPC_STAGING_MIB": "2", **env}) as srv:
        client = CacheClient(srv.url)
        try:
            src = make_kv(spec, "cuda", seed=6)
            dst = [torch.zeros_like(t) for t in src]
            a = client.register(src, model_name="paths", block_size=16, transport="cuda_ipc")
            b = client.register(dst, model_name="paths", block_size=16, transport="cuda_ipc")
            gen = torch.Generator().manual_seed(7)
            n, per = 6, 2  # requests, chunks each (192 of the 256 blocks: the rest must stay zero)
            src_blocks = torch.randperm(spec.num_blocks, generator=gen)[:n * per * 16].view(n, -1).tolist()
            dst_blocks = torch.randperm(spec.num_blocks, generator=gen)[:n * per * 16].view(n, -1).tolist()
            keys = [_keys(per) for _ in range(n)]
            stores = [a.submit_store(keys[i], src_blocks[i]) for i in range(n)]
            assert [f.result(60).stored for f in stores] == [list(range(per))] * n
            skips = [16 * (i % 3) for i in range(n)]  # 0, 1 or 2 blocks of the first chunk skipped
            loads = [b.submit_retrieve(keys[i], dst_blocks[i], skip_first_n_tokens=skips[i]) for i in range(n)]
            assert all(f.result(60).ok for f in loads)
            got_all, want_all = as_bytes([t.cpu() for t in dst]), as_bytes([t.cpu() for t in src])
            for i in range(n):
                k = skips[i] // 16
                want = get_chunks(want_all, spec, src_blocks[i][k:], 1)
                assert torch.equal(get_chunks(got_all, spec, dst_blocks[i][k:], 1), want), f"request {i}"
                assert not get_chunks(got_all, spec, dst_blocks[i][:k], 1).any(), f"request {i}: skipped blocks"
            written = {blk for i in range(n) for blk in dst_blocks[i][skips[i] // 16:]}
            others = [blk for blk in range(spec.num_blocks) if blk not in written]
            assert not get_chunks(got_all, spec, others, 1).any(), "blocks no request named were written"
        finally:
            client.close()


@needs_cuda
def test_store_waits_for_the_engine_stream(server: ServerProcess) -> None:
    """Blocks written on the engine's stream just before submit_store are stored as written,
    though the write is still running when the request is submitted."""
    spec = SPEC
    client = CacheClient(server.url)
    try:
        layers = [torch.zeros(spec.layer_shape(), dtype=torch.bfloat16, device="cuda") for _ in range(spec.num_layers)]
        torch.cuda.synchronize()
        ctx = client.register(layers, model_name="order", block_size=16, transport="cuda_ipc")
        keys = _keys(1)
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the writes
            for t in layers:
                t.fill_(1.5)
            fut = ctx.submit_store(keys, list(range(16)))
        assert fut.result(60).stored == [0]
        out = [torch.zeros_like(t) for t in layers]
        back = client.register(out, model_name="order", block_size=16, transport="cuda_ipc")
        assert back.submit_retrieve(keys, list(range(16))).result(60).ok
        for t in out:
            assert bool((t[:, :16] == 1.5).all())
    finally:
        client.close()


@needs_cuda
def test_concurrent_submits_from_threads_keep_their_events(server: ServerProcess) -> None:
    spec = SPEC
    client = CacheClient(server.url)
    try:
        src = make_kv(spec, "cuda", seed=4)
        ctx = client.register(src, model_name="threads", block_size=16, transport="cuda_ipc")
        keys = [_keys(1) for _ in range(8)]
        futs: list = []
        lock = threading.Lock()

        def work(i: int) -> None:
            f = ctx.submit_store(keys[i], list(range(i * 16, i * 16 + 16)))
            with lock:
                futs.append(f)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(f.result(60).stored == [0] for f in futs)
        out = [torch.zeros_like(t) for t in src]
        back = client.register(out, model_name="threads", block_size=16, transport="cuda_ipc")
        for i in range(8):
            assert back.submit_retrieve(keys[i], list(range(i * 16, i * 16 + 16))).result(60).ok
        for a, b in zip(as_bytes(src), as_bytes(out)):
            assert torch.equal(a[:, :128], b[:, :128])
    finally:
        client.close()


@needs_cuda
def test_a_retrieve_whose_done_event_does_not_open_is_refused_without_waiting_for_the_device(
        server: ServerProcess) -> None:
    """A retrieve whose params.done_event is not an interprocess event is refused with a message
    naming the field, while another context's copies are still held up by its engine's stream:
    the refusal waits for no copy (the request may be served on the server's loop)."""
    from kvxfer.protocol import messages as m

    spec = SPEC
    client = CacheClient(server.url)
    try:
        src = make_kv(spec, "cuda", seed=8)
        busy = client.register(src, model_name="busy", block_size=16, transport="cuda_ipc")
        other = client.register([torch.zeros_like(t) for t in src], model_name="busy", block_size=16,
                                transport="cuda_ipc")
        keys = _keys(1)
        assert busy.submit_store(keys, list(range(16))).result(60).stored == [0]
        for ctx in (busy, other):  # both warm: a lone request may run on the server's loop
            assert ctx.submit_retrieve(keys, list(range(16))).result(60).ok
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(5_000_000_000)  # seconds of GPU time ahead of busy's retrieve
            slept = torch.cuda.Event()
            slept.record(engine)
            held = busy.submit_retrieve(keys, list(range(16, 32)))
        params = msgspec.Raw(msgspec.msgpack.encode(CudaIpcParams(done_event=b"\x03" * 64)))
        with pytest.raises(RemoteError, match="done_event"):
            client.request(m.Retrieve(other.instance_id, keys, list(range(16)), 0, 0, params, 0.0, []))
        assert not slept.query()  # refused while busy's copies still wait for its engine
        assert held.result(120).ok
    finally:
        client.close()


@needs_cuda
def test_a_gpu_the_server_cannot_see_is_refused_by_name(server: ServerProcess) -> None:
    spec = SPEC
    client = CacheClient(server.url)
    try:
        layers = make_kv(spec, "cuda", seed=5)
        ctx = get_transport("cuda_ipc").client_context(
            client, layers, KVLayout.infer(layers, 16), InstanceIdentity(secrets.randbits(62) + 1, "refused", 1, 0))
        fake = "GPU-deadbeef-0000-0000-0000-000000000000"
        ctx._shared = [msgspec.structs.replace(t, device_uuid=fake) for t in ctx._shared]
        with pytest.raises(RemoteError, match=fake):
            ctx.register()
        ctx.close()
        assert client.status().contexts == []
    finally:
        client.close()


@needs_cuda
def test_status_names_the_device_and_close_drops_the_mappings(server: ServerProcess) -> None:
    client = CacheClient(server.url)
    try:
        layers = make_kv(SPEC, "cuda", seed=6)
        ctx = client.register(layers, model_name="status", block_size=16, transport="cuda_ipc")
        st = client.status()
        (mine,) = [c for c in st.contexts if c.model_name == "status"]
        assert mine.transport == "cuda_ipc"
        (tp,) = [t for t in st.transports if t.name == "cuda_ipc"]
        assert torch.cuda.get_device_name(0) in tp.state["devices"]
        assert tp.state["arena_pinned"] != "no"
        ctx.close()
        assert not [c for c in client.status().contexts if c.model_name == "status"]
    finally:
        client.close()



@needs_cuda
def test_layerwise_retrieve_and_store(server: ServerProcess) -> None:
    """A layer-wise retrieve is sent as requests of a range of layers each (Retrieve.layers):
    every layer is in the engine's blocks when wait_layer returns. A layer-wise store written
    layer by layer on the engine's stream, declared ready without synchronizing, stores what the
    engine wrote (its one request waits for the event of the last declaration)."""
    spec = SPEC
    client = CacheClient(server.url)
    try:
        assert "retrieve_layers" in client.features
        src = make_kv(spec, "cuda", seed=5)
        dst = [torch.zeros_like(t) for t in src]
        a = client.register(src, model_name="layerwise", block_size=16, transport="cuda_ipc")
        b = client.register(dst, model_name="layerwise", block_size=16, transport="cuda_ipc")
        keys = _keys(3)
        blocks = list(range(48))
        engine = torch.cuda.Stream()
        fut = a.submit_store(keys, blocks, by_layer=True)
        with torch.cuda.stream(engine):
            for i, t in enumerate(src):
                torch.cuda._sleep(20_000_000)
                t[:, blocks] = t[:, blocks] * 2 + 1
                fut.layer_ready(i)
        assert fut.result(60).stored == [0, 1, 2]
        torch.cuda.synchronize()
        back = b.submit_retrieve(keys, blocks[::-1], by_layer=True)
        for i in range(spec.num_layers):
            back.wait_layer(i, timeout=60)
            assert torch.equal(dst[i][:, blocks[::-1]].view(torch.int16), src[i][:, blocks].view(torch.int16)), i
        assert back.result(60).loaded == [0, 1, 2]
        a.close()
        b.close()
    finally:
        client.close()


@needs_cuda
@pytest.mark.parametrize("field,value", [("ref_counter_handle", b"/kvxfer-0-arena"),
                                         ("ref_counter_handle", b"/torch_1_2/../x"),
                                         ("ref_counter_offset", 10_000), ("ref_counter_offset", -1)])
def test_a_reference_counter_that_is_not_torchs_is_refused(server: ServerProcess, field: str, value: object) -> None:
    """torch opens the reference-counter name as shared memory and decrements the slot when the
    server drops the storage: a registration may name only torch's own counter files and slots."""
    client = CacheClient(server.url)
    try:
        layers = make_kv(SPEC, "cuda", seed=7)
        ctx = get_transport("cuda_ipc").client_context(
            client, layers, KVLayout.infer(layers, 16), InstanceIdentity(secrets.randbits(62) + 1, "refcount", 1, 0))
        ctx._shared = [msgspec.structs.replace(t, **{field: value}) for t in ctx._shared]
        with pytest.raises(RemoteError, match="reference counter"):
            ctx.register()
        ctx.close()
        assert client.status().contexts == []
    finally:
        client.close()


@needs_cuda
@pytest.mark.parametrize("claim", ["to_the_end", "one_byte_past", "past_the_end"])
def test_a_storage_claimed_beyond_its_allocation_is_refused(server: ServerProcess, claim: str) -> None:
    """A layer's storage size and offset are the client's word: torch opens the handle at the
    allocation's start plus the offset and takes the size as given, and the copies reach every
    byte of the storage. The server checks the claim against the allocation the driver knows: a
    storage that reaches one byte past it, or starts past its end, is refused (beyond lies
    whatever else the server has mapped, other engines' KV caches included); one that ends
    exactly at its end is taken."""
    client = CacheClient(server.url)
    try:
        layers = make_kv(SPEC, "cuda", seed=9)
        ctx = get_transport("cuda_ipc").client_context(
            client, layers, KVLayout.infer(layers, 16), InstanceIdentity(secrets.randbits(62) + 1, "claim", 1, 0))
        t = ctx._shared[0]
        # the allocation the engine's handle names, as the driver of this (the exporting) process knows it
        found = _driver.allocation_range(layers[0].untyped_storage().data_ptr() - t.storage_offset_bytes)
        assert found is not None
        size = found[1]
        claims = {"to_the_end": (t.storage_offset_bytes, size - t.storage_offset_bytes),
                  "one_byte_past": (t.storage_offset_bytes, size - t.storage_offset_bytes + 1),
                  "past_the_end": (size, t.storage_size_bytes)}
        offset, nbytes = claims[claim]
        ctx._shared = [msgspec.structs.replace(t, storage_offset_bytes=offset, storage_size_bytes=nbytes)] + ctx._shared[1:]
        if claim == "to_the_end":
            ctx.register()
            assert [c.model_name for c in client.status().contexts] == ["claim"]
        else:
            with pytest.raises(RemoteError, match="does not lie inside"):
                ctx.register()
            assert client.status().contexts == []
        ctx.close()
    finally:
        client.close()


_EXPANDABLE_ROUND_TRIP = """
import os, secrets, struct, sys, msgspec, torch
from kvxfer import CacheClient, KVLayout, RemoteError, chunk_hashes
from kvxfer.testing.kvdata import KVSpec, as_bytes, get_chunks, make_kv
from kvxfer.transport import InstanceIdentity, LayoutKind, get_transport
spec = KVSpec(LayoutKind.FLASH_ATTN, "bfloat16", num_layers=4, num_blocks=256, block_size=16, heads=8, head_size=128)
client = CacheClient(sys.argv[1])
src = make_kv(spec, "cuda", seed=10)
dst = [torch.zeros_like(t) for t in src]
try:
    a = client.register(src, model_name="expandable", block_size=16, transport="cuda_ipc")
except Exception as exc:
    print("register failed:", exc)
    raise SystemExit(3 if "could not open its CUDA IPC handle" in str(exc) else 1)
b = client.register(dst, model_name="expandable", block_size=16, transport="cuda_ipc")
keys = chunk_hashes(list(range(4 * 256)), chunk_size=256, salt=b"expandable")
assert a.submit_store(keys, list(range(64))).result(60).stored == [0, 1, 2, 3]
assert b.submit_retrieve(keys, list(range(64, 128))).result(60).ok
want = get_chunks(as_bytes([t.cpu() for t in src]), spec, list(range(64)), 1)
assert torch.equal(get_chunks(as_bytes([t.cpu() for t in dst]), spec, list(range(64, 128)), 1), want)
# a claim that ends where the handle's pages end is taken; one byte further is refused. The pages
# are those torch's handle names: its format version, b"e", a header (pid, page size, pages), then
# a descriptor each
t = a._shared[0]
assert t.handle[1:2] == b"e", t.handle[:2]
pid, page, pages = struct.unpack_from("@iQQ", t.handle, 2)
assert pid == os.getpid() and page in (2 << 20, 20 << 20) and pages >= 1, (pid, page, pages)
mapped = page * pages
# a handle naming another process (its descriptors would be taken from there): refused before
# torch opens it
other = bytearray(t.handle)
struct.pack_into("@i", other, 2, os.getppid())
for extra, refused in ((0, None), (1, "reaches past the"), (None, "names the memory of process")):
    ctx = get_transport("cuda_ipc").client_context(
        client, src, KVLayout.infer(src, 16), InstanceIdentity(secrets.randbits(62) + 1, "claim", 1, 0))
    claim = {"handle": bytes(other)} if extra is None else \\
        {"storage_size_bytes": mapped - t.storage_offset_bytes + extra}
    ctx._shared = [msgspec.structs.replace(ctx._shared[0], **claim)] + ctx._shared[1:]
    try:
        ctx.register()
        assert refused is None, f"taken: {claim}"
    except RemoteError as exc:
        assert refused is not None and refused in str(exc), exc
    ctx.close()
client.close()
print("round trip ok, claims checked")
"""


@needs_cuda
def test_an_engine_with_expandable_segments_registers_and_round_trips(server: ServerProcess, tmp_path) -> None:
    """With PyTorch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``)
    a handle names pages that the server maps one by one: a storage across several of them is
    taken and its bytes round-trip, one that reaches past the last of them is refused, and so is
    a handle naming another process than the engine's (the server would take that process's
    page descriptors, and map its memory into this registration). Skipped
    where this host does not let the server open such handles at all (they are shared as file
    descriptors taken from the engine's process)."""
    script = tmp_path / "expandable.py"
    script.write_text(_EXPANDABLE_ROUND_TRIP)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    run = subprocess.run([sys.executable, str(script), server.url], env=env, capture_output=True, text=True, timeout=300)
    if run.returncode == 3:
        pytest.skip(f"this host opens no expandable-segment handle: {run.stdout.strip()[-300:]}")
    assert run.returncode == 0 and "round trip ok, claims checked" in run.stdout, run.stdout + run.stderr


_EXPANDABLE_OVER_TCP = """
import sys
from kvxfer import CacheClient, RemoteError
from kvxfer.security import load_client_keys
from kvxfer.testing.kvdata import KVSpec, make_kv
from kvxfer.transport import LayoutKind
spec = KVSpec(LayoutKind.FLASH_ATTN, "bfloat16", num_layers=2, num_blocks=64, block_size=16, heads=8, head_size=128)
client = CacheClient(sys.argv[1], curve=load_client_keys(sys.argv[2]), connect_timeout=60)
src = make_kv(spec, "cuda", seed=11)
try:
    client.register(src, model_name="expandable-tcp", block_size=16, transport="cuda_ipc")
    print("taken")
except RemoteError as exc:
    print("refused:", exc)
client.close()
"""


@needs_cuda
def test_an_expandable_segments_kv_cache_is_refused_where_the_server_cannot_tell_its_process(tmp_path) -> None:
    """Over ``tcp://`` (as from another PID namespace) the server has no word of the kernel's for
    the process that registers: an expandable-segment handle, which names a process whose page
    descriptors torch would take, is then refused with what to do, before torch opens it."""
    import socket

    from kvxfer.security import make_keys

    make_keys(tmp_path / "keys")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "expandable_tcp.py"
    script.write_text(_EXPANDABLE_OVER_TCP)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    with ServerProcess(l1_size="64MiB", url=f"tcp://127.0.0.1:{port}", transports="cuda_ipc",
                       curve_dir=tmp_path / "keys") as srv:
        run = subprocess.run([sys.executable, str(script), srv.url, str(tmp_path / "keys")], env=env,
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "refused:" in run.stdout and "cannot tell which process registers it" in run.stdout, run.stdout


@needs_cuda
def test_a_kv_cache_larger_than_the_gpu_is_refused(server: ServerProcess) -> None:
    client = CacheClient(server.url)
    try:
        layers = make_kv(SPEC, "cuda", seed=8)
        ctx = get_transport("cuda_ipc").client_context(
            client, layers, KVLayout.infer(layers, 16), InstanceIdentity(secrets.randbits(62) + 1, "huge", 1, 0))
        lay = ctx.layout
        per_block = lay.num_layers * lay.row_bytes  # at least one row of every layer per block
        blocks = max(torch.cuda.get_device_properties(i).total_memory
                     for i in range(torch.cuda.device_count())) // per_block + 1
        real = ctx.registration

        def huge() -> msgspec.Struct:  # the same layout with more blocks: planes that far apart
            reg = real()
            offsets = [o // reg.num_blocks * blocks + o % reg.num_blocks for o in reg.run_offsets]
            return msgspec.structs.replace(reg, num_blocks=blocks, run_offsets=offsets)

        ctx.registration = huge  # type: ignore[method-assign]
        with pytest.raises(RemoteError, match="more than this transport can address"):
            ctx.register()
        ctx.close()
    finally:
        client.close()


# --------------------------------------------------------------------------- metrics


def test_metric_samples_are_exportable_and_totals_only_grow() -> None:
    from kvxfer.server.figures import check_sample
    from kvxfer_cuda_ipc.metrics import CopyTotals, metric_samples

    totals = CopyTotals()
    totals.add("store", 1 << 20, 0.5)
    totals.add("store", 1 << 20, 0.25)
    totals.add("retrieve", 4096, 0.125)
    samples = metric_samples(totals.read(), {"cuda:0": 2 << 20}, {"cuda:0": 3}, 1 << 30)
    assert [check_sample(s) for s in samples] == [""] * len(samples)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert got[("kvxfer_cuda_ipc_copies_total", (("op", "store"),))] == 2
    assert got[("kvxfer_cuda_ipc_copied_bytes_total", (("op", "store"),))] == 2 << 20
    assert got[("kvxfer_cuda_ipc_copy_seconds_total", (("op", "retrieve"),))] == 0.125
    assert got[("kvxfer_cuda_ipc_staging_bytes", (("device", "cuda:0"),))] == 2 << 20
    assert got[("kvxfer_cuda_ipc_contexts", (("device", "cuda:0"),))] == 3
    assert got[("kvxfer_cuda_ipc_arena_pinned_bytes", ())] == 1 << 30


@needs_cuda
def test_copy_time_and_staging_reach_status_and_metrics(server: ServerProcess) -> None:
    client = CacheClient(server.url)
    try:
        def figures() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in client.status().plugin_metrics}

        before = figures()
        src = make_kv(SPEC, "cuda", seed=7)
        ctx = client.register(src, model_name="metrics", block_size=16, transport="cuda_ipc")
        keys = _keys(2)
        assert ctx.submit_store(keys, list(range(32))).result(60).stored == [0, 1]
        assert ctx.submit_retrieve(keys, list(range(32, 64))).result(60).loaded == [0, 1]
        after = figures()
        chunk = KVLayout.infer(src, 16).chunk_bytes(256)
        store, retrieve = (("op", "store"),), (("op", "retrieve"),)
        for key, want in ((("kvxfer_cuda_ipc_copies_total", store), 1),
                          (("kvxfer_cuda_ipc_copied_bytes_total", store), 2 * chunk),
                          (("kvxfer_cuda_ipc_copies_total", retrieve), 1),
                          (("kvxfer_cuda_ipc_copied_bytes_total", retrieve), 2 * chunk)):
            assert after[key] - before.get(key, 0.0) == want, key
        assert after[("kvxfer_cuda_ipc_copy_seconds_total", store)] > before.get(
            ("kvxfer_cuda_ipc_copy_seconds_total", store), 0.0)
        device = (("device", f"cuda:{torch.cuda.current_device()}"),)
        assert after[("kvxfer_cuda_ipc_staging_bytes", device)] >= 2 * chunk  # a ring of at least 2 chunks
        assert after[("kvxfer_cuda_ipc_contexts", device)] >= 1
        st = client.status()
        (tp,) = [t for t in st.transports if t.name == "cuda_ipc"]
        assert after[("kvxfer_cuda_ipc_arena_pinned_bytes", ())] == int(tp.state["arena_pinned"].split()[0]) > 0
        (traffic,) = [t for t in st.traffic if t.model == "metrics"]
        assert (traffic.stored_chunks, traffic.loaded_chunks) == (2, 2)
        assert traffic.store_copy_s > 0 and traffic.retrieve_copy_s > 0  # timed by the core around the copy
        ctx.close()
    finally:
        client.close()


@needs_cuda
def test_after_the_first_store_and_retrieve_no_copy_compiles_a_kernel(tmp_path) -> None:
    """Once a store and a retrieve have run, the server may queue a lone request on its loop
    thread (queues_only), so no later request may compile a Triton kernel there: requests that
    skip blocks (odd row counts) and layer-wise retrieves from odd layers (6 layers: one layer a
    part) reuse the kernels the first two compiled. Counted in the server's own Triton cache
    directory (a new kernel specialization is a new entry)."""
    cache = tmp_path / "triton"
    spec = KVSpec(LayoutKind.FLASH_ATTN, "bfloat16", num_layers=6, num_blocks=128, block_size=16, heads=8,
                  head_size=128)
    with ServerProcess(l1_size="1GiB", chunk_size=256, transports="cuda_ipc",
                       env={"TRITON_CACHE_DIR": str(cache)}) as srv:
        client = CacheClient(srv.url)
        try:
            src = make_kv(spec, "cuda", seed=7)
            dst = [torch.zeros_like(t) for t in src]
            a = client.register(src, model_name="compile-once", block_size=16, transport="cuda_ipc")
            b = client.register(dst, model_name="compile-once", block_size=16, transport="cuda_ipc")
            keys = _keys(3)
            assert a.submit_store(keys[:2], list(range(32))).result(120).stored == [0, 1]
            assert b.submit_retrieve(keys[:2], list(range(64, 96))).result(120).loaded == [0, 1]
            compiled = sorted(p.name for p in cache.iterdir())
            assert compiled, "the server compiled no kernel (is Triton installed?)"
            assert a.submit_store(keys, list(range(48))).result(60).stored == [2]
            assert b.submit_retrieve(keys, list(range(48, 96)), skip_first_n_tokens=16).result(60).loaded == [0, 1, 2]
            back = b.submit_retrieve(keys, list(range(96, 128)) + list(range(16)), by_layer=True)
            assert back.result(60).loaded == [0, 1, 2]
            want = get_chunks(as_bytes([t.cpu() for t in src]), spec, list(range(48)), 1)
            got = get_chunks(as_bytes([t.cpu() for t in dst]), spec, list(range(96, 128)) + list(range(16)), 1)
            assert torch.equal(got, want)
            assert sorted(p.name for p in cache.iterdir()) == compiled
        finally:
            client.close()


# --------------------------------------------------------------------------- prefetch at lookup


def _prefetch_figures(client: CacheClient) -> tuple[int, int]:
    """The server's (chunks prefetched, retrieved chunks found prefetched) so far."""
    (tp,) = [t for t in client.status().transports if t.name == "cuda_ipc"]
    return int(tp.state["prefetched"]), int(tp.state["prefetch_hits"])


def _loader(client: CacheClient, model: str, n: int, seed: int,
            stores: bool = True) -> tuple[list[torch.Tensor], list[bytes], list[int], list[torch.Tensor], object]:
    """``n`` chunks of ``model`` stored from an instance that is then closed, and the instance
    that loads them registered alone and warmed up by a store and a retrieve of its own (with
    ``stores=False``, by a retrieve alone, as an engine that only loads: its staging made, its
    copies not ``queues_only``): (source, keys, source blocks, its layers, its context)."""
    src = make_kv(SPEC, "cuda", seed=seed)
    a = client.register(src, model_name=model, block_size=16, transport="cuda_ipc")
    keys = _keys(n)
    src_blocks = torch.randperm(SPEC.num_blocks, generator=torch.Generator().manual_seed(seed))[:n * 16].tolist()
    assert a.submit_store(keys, src_blocks).result(60).stored == list(range(n))
    a.close()
    dst = [torch.zeros_like(t) for t in src]
    b = client.register(dst, model_name=model, block_size=16, transport="cuda_ipc")
    warm = _keys(1)
    if stores:
        assert b.submit_store(warm, list(range(16))).result(60).stored == [0]
        assert b.submit_retrieve(warm, list(range(16))).result(60).loaded == [0]
    else:
        a = client.register(src, model_name=model, block_size=16, transport="cuda_ipc")
        assert a.submit_store(warm, list(range(16))).result(60).stored == [0]
        a.close()
        assert b.submit_retrieve(warm, list(range(16))).result(60).loaded == [0]
    return src, keys, src_blocks, dst, b


@needs_cuda
def test_an_instance_that_only_loads_is_prefetched_from_its_second_load(server: ServerProcess) -> None:
    """An engine that never stores (its copies run on its worker, not queues_only) gets its
    chunks staged once its first load made the staging ring, and loads exact bytes."""
    client = CacheClient(server.url)
    try:
        src, keys, src_blocks, dst, b = _loader(client, "prefetch-load-only", 3, seed=51, stores=False)
        before = _prefetch_figures(client)
        reply = client.lookup_and_lease("prefetch-load-only", 1, hashes=keys, lease_s=30, prefetch=True)
        assert _prefetch_figures(client)[0] - before[0] == 2
        dst_blocks = list(range(128, 176))
        assert b.submit_retrieve(keys, dst_blocks, lease_id=reply.lease_id).result(60).loaded == [0, 1, 2]
        want = get_chunks(as_bytes([t.cpu() for t in src]), SPEC, src_blocks, 1)
        assert torch.equal(get_chunks(as_bytes([t.cpu() for t in dst]), SPEC, dst_blocks, 1), want)
        assert _prefetch_figures(client)[1] - before[1] == 2
        b.close()
    finally:
        client.close()


@needs_cuda
@pytest.mark.parametrize(("looked_up", "skip", "hits", "hits_restaged"), [
    (0, 0, 2, 2),    # the ring's two buffers staged with the first two chunks: both scattered from there
    (0, 48, 1, 2),   # the first chunk cut by the skip is copied from the arena; the second found staged
                     # (restaged: the second and third; the cut copy waits for a buffer they free)
    (3, 0, 2, 2),    # chunks 3 and 4 staged (restaged: 0 and 1): scattered first, the others take
                     # their buffers once they are free
])
def test_a_lookup_with_prefetch_stages_the_leased_chunks_and_the_retrieve_loads_exact_bytes(
        server: ServerProcess, looked_up: int, skip: int, hits: int, hits_restaged: int) -> None:
    """``hits_restaged``: the retrieve is lone, so the server stages its whole chunks too; once
    the lookup's DMAs are done (else nothing is queued) the ring then holds its first two chunks
    (after a cut first one: the one staged at the lookup, kept, and the next). Staged chunks are
    never given up to another copy, so none is copied twice."""
    n = 5
    client = CacheClient(server.url)
    try:
        src, keys, src_blocks, dst, b = _loader(client, f"prefetch-{looked_up}-{skip}", n, seed=11 + looked_up + skip)
        before = _prefetch_figures(client)
        reply = client.lookup_and_lease(b.identity.model_name, 1, hashes=keys[looked_up:], lease_s=30, prefetch=True)
        assert reply.hits == n - looked_up
        staged = _prefetch_figures(client)
        assert staged[0] - before[0] == 2 and staged[1] == before[1]  # the ring holds two chunks
        dst_blocks = list(range(128, 128 + n * 16))
        res = b.submit_retrieve(keys, dst_blocks, skip_first_n_tokens=skip, lease_id=reply.lease_id).result(60)
        assert res.loaded == list(range(n))
        restaged = _prefetch_figures(client)[0] - staged[0]
        first = skip // 16
        want = get_chunks(as_bytes([t.cpu() for t in src]), SPEC, src_blocks[first:], 1)
        got = get_chunks(as_bytes([t.cpu() for t in dst]), SPEC, dst_blocks[first:], 1)
        assert torch.equal(got, want)
        assert _prefetch_figures(client)[1] - staged[1] == (hits if restaged == 0 else hits_restaged)
        b.close()
    finally:
        client.close()


@needs_cuda
def test_what_a_prefetch_staged_is_not_loaded_after_a_store_or_for_chunks_stored_again(server: ServerProcess) -> None:
    """A store between the prefetch and the retrieve reuses the ring: it stores its own bytes
    (its gathers wait for the prefetch's DMAs into the same buffers), and nothing staged is
    used. Chunks dropped and stored again under the same keys (other bytes, perhaps in the
    same slots) are new chunks to the prefetch: they load as stored now. (Each retrieve here is
    lone: the server stages its chunks itself, and it may find those.)"""
    n = 2
    client = CacheClient(server.url)
    try:
        src, keys, src_blocks, dst, b = _loader(client, "prefetch-stale", n, seed=21)
        for t, fill in zip(dst, make_kv(SPEC, "cuda", seed=29)):  # what the store below stores
            t.copy_(fill)
        torch.cuda.synchronize()
        stored = get_chunks(as_bytes([t.cpu() for t in dst]), SPEC, list(range(16, 32)), 1)
        before = _prefetch_figures(client)
        reply = client.lookup_and_lease("prefetch-stale", 1, hashes=keys, lease_s=30, prefetch=True)
        key = _keys(1)
        assert b.submit_store(key, list(range(16, 32))).result(60).stored == [0]
        assert b.submit_retrieve(keys, list(range(128, 160)), lease_id=reply.lease_id).result(60).loaded == [0, 1]
        want = get_chunks(as_bytes([t.cpu() for t in src]), SPEC, src_blocks, 1)
        assert torch.equal(get_chunks(as_bytes([t.cpu() for t in dst]), SPEC, list(range(128, 160)), 1), want)
        assert b.submit_retrieve(key, list(range(192, 208))).result(60).loaded == [0]
        assert torch.equal(get_chunks(as_bytes([t.cpu() for t in dst]), SPEC, list(range(192, 208)), 1), stored)
        after = _prefetch_figures(client)
        # of what the lookup's prefetch staged (2 chunks), nothing was scattered: every hit is a
        # chunk a lone retrieve staged itself after the store
        assert after[0] - before[0] >= 2 and after[1] - before[1] == after[0] - before[0] - 2

        reply = client.lookup_and_lease("prefetch-stale", 1, hashes=keys, lease_s=30, prefetch=True)
        looked = _prefetch_figures(client)
        assert looked[0] - after[0] == 2
        client.release_lease(reply.lease_id)
        assert client.clear("prefetch-stale") >= 2
        new = make_kv(SPEC, "cuda", seed=23)
        a = client.register(new, model_name="prefetch-stale", block_size=16, transport="cuda_ipc")
        assert a.submit_store(keys, src_blocks).result(60).stored == [0, 1]
        a.close()
        assert b.submit_retrieve(keys, list(range(160, 192))).result(60).loaded == [0, 1]
        want = get_chunks(as_bytes([t.cpu() for t in new]), SPEC, src_blocks, 1)
        assert torch.equal(get_chunks(as_bytes([t.cpu() for t in dst]), SPEC, list(range(160, 192)), 1), want)
        end = _prefetch_figures(client)  # the old stamps staged at the lookup never hit; the new ones
        assert end[1] - looked[1] == end[0] - looked[0]  # the retrieve staged itself may

        b.close()
    finally:
        client.close()
