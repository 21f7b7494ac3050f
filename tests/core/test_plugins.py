"""Transport registry and hooks, end to end through a really installed plugin distribution
(tests/fixtures/kvxfer-test-transport, pip-installed into a private directory by conftest).

Subprocesses see it through PYTHONPATH; this module also puts it on ``sys.path`` of the test
process (and takes it off again afterwards) so that a client here can use ``test_loop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvxfer import CacheClient, chunk_hashes
from kvxfer.errors import (
    InvalidRequest,
    LimitExceeded,
    RequestTimeout,
    ServerInternalError,
    TransportBroken,
    TransportNotFound,
    TransportUnavailable,
    UnknownInstance,
)
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.testing.server import ServerProcess
from kvxfer.transport import registry
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, env_with, flash_attn_kv, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def on_path(test_plugin_path: Path):
    """The test plugin importable and discoverable in this process, for this module only."""
    sys.path.insert(0, str(test_plugin_path))
    registry.refresh()
    yield test_plugin_path
    sys.path.remove(str(test_plugin_path))
    registry.refresh()
    for name in [n for n in sys.modules if n.startswith("kvxfer_test_transport")]:
        del sys.modules[name]


def kvxfer_cmd(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


# --------------------------------------------------------------------------- discovery (subprocesses)


def test_plugins_json_lists_every_plugin_with_its_health(test_plugin_path: Path) -> None:
    proc = kvxfer_cmd("plugins", "--json", env=env_with(test_plugin_path))
    assert proc.returncode == 1, proc.stderr  # test_broken and test_oldapi are broken: a CI check can tell
    assert "test_broken" not in proc.stderr  # said once, in the listing
    report = json.loads(proc.stdout)
    assert report["entry_point_group"] == "kvxfer.transports" and report["api_version"] == 2
    by_name = {p["name"]: p for p in report["transports"]}
    loop = by_name["test_loop"]
    assert (loop["health"], loop["distribution"], loop["version"], loop["style"], loop["api_version"]) == \
        ("available", "kvxfer-test-transport", "0.0.1", "server_driven", 2)
    assert loop["target"] == "kvxfer_test_transport:LoopTransport"
    broken = by_name["test_broken"]
    assert broken["health"] == "broken" and "ImportError" in broken["detail"]
    assert "no-such-dependency" in broken["detail"] and "kvxfer-test-transport" in broken["detail"]
    old = by_name["test_oldapi"]
    assert old["health"] == "broken" and "api_version 0" in old["detail"] and "implements 2" in old["detail"]
    assert "a plugin declares api_version = kvxfer.transport.API_VERSION" in old["detail"]
    nodev = by_name["test_nodevice"]
    assert nodev["health"] == "unavailable" and "no test accelerator" in nodev["detail"]
    notypes = by_name["test_notypes"]  # available by its probe, yet no device could use it
    assert notypes["health"] == "unavailable" and "named no device types" in notypes["detail"]
    # broken neighbours break nothing else
    assert by_name["cpu_gather"]["health"] == "available"


def test_plugins_table(test_plugin_path: Path) -> None:
    proc = kvxfer_cmd("plugins", env=env_with(test_plugin_path))
    assert proc.returncode == 1, proc.stderr
    assert "test_broken" not in proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("test_")}
    assert "available" in rows["test_loop"] and "kvxfer-test-transport" in rows["test_loop"]
    assert "broken" in rows["test_broken"] and "unavailable" in rows["test_nodevice"]
    assert "test_broken: transport plugin 'test_broken'" in proc.stdout


def test_serve_refuses_a_broken_transport_named_on_its_command_line(test_plugin_path: Path, tmp_path: Path) -> None:
    env = env_with(test_plugin_path)
    base = ["serve", "--url", f"ipc://{tmp_path}/run/s.sock", "--l1-size", "8MiB"]
    proc = kvxfer_cmd(*base, "--transports", "cpu_gather,test_broken", env=env)
    assert proc.returncode == 2 and "no-such-dependency" in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "s.sock").exists()


# --------------------------------------------------------------------------- registry (in process)


def test_registry_errors(on_path) -> None:
    with pytest.raises(TransportNotFound) as info:
        registry.get_transport("nope")
    assert "installed:" in str(info.value) and "cpu_gather (kvxfer-cpu-gather)" in str(info.value)
    for name in ("cpu_gather", "test_loop", "test_broken"):
        assert name in str(info.value)
    assert "kvxfer-nope" not in str(info.value)  # no distribution of that name exists
    with pytest.raises(TransportBroken, match="no-such-dependency"):
        registry.get_transport("test_broken")
    with pytest.raises(TransportBroken, match="api_version 0, this kvxfer implements 2"):
        registry.get_transport("test_oldapi")
    with pytest.raises(TransportUnavailable, match="no test accelerator"):
        registry.get_transport("test_nodevice")
    assert registry.get_transport("test_nodevice", require_available=False).name == "test_nodevice"
    assert registry.get_transport("cpu_gather").name == "cpu_gather"
    assert registry.get_transport("test_loop").name == "test_loop"


def test_auto_picks_by_device(on_path) -> None:
    assert registry.select("auto", torch.device("cpu")).name == "test_loop"  # priority 50 on cpu
    other = registry.select("auto", torch.device("meta"))  # test_loop serves cpu only
    assert other.name != "test_loop" and other.serves(torch.device("meta"))
    with pytest.raises(TransportUnavailable, match="cannot move KV tensors on device meta"):
        registry.select("test_loop", torch.device("meta"))


def _distribution(root: Path, name: str, entry_points: str) -> Path:
    """A distribution's dist-info under ``root`` (the directory a test puts on ``sys.path``):
    ``entry_points`` is its ``[kvxfer.transports]`` lines. Returns its entry_points.txt."""
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    points = info / "entry_points.txt"
    points.write_text(f"[kvxfer.transports]\n{entry_points}")
    return points


@contextlib.contextmanager
def _importable(root: Path, module: str, source: str) -> Iterator[None]:
    """``module`` (``source``) and the distributions under ``root`` found by this process's
    registry for the block; forgotten after it."""
    (root / f"{module}.py").write_text(source)
    sys.path.insert(0, str(root))
    try:
        registry.refresh()
        yield
    finally:
        sys.path.remove(str(root))
        sys.modules.pop(module, None)
        registry.refresh()


_TRANSPORT = "from kvxfer_cpu_gather import CpuGatherTransport\n"


def test_an_entry_point_added_after_a_first_load_is_found_after_refresh(tmp_path: Path) -> None:
    """A distribution gains a second transport (pip install -e . after editing its entry points):
    after ``refresh()`` it loads. Looked up again in stevedore's cache of entry points (in the
    process, and on disk keyed on ``sys.path``'s modification times in steps of about two
    minutes), it was listed and then reported broken ("No 'kvxfer.transports' driver found")."""
    points = _distribution(tmp_path, "kvxfer-late", "late_first = kvxfer_late:First\n")
    with _importable(tmp_path, "kvxfer_late", _TRANSPORT
                     + "class First(CpuGatherTransport):\n    name = 'late_first'\n    production = False\n"
                     + "class Second(CpuGatherTransport):\n    name = 'late_second'\n    production = False\n"):
        assert registry.get_transport("late_first").name == "late_first"
        points.write_text(points.read_text() + "late_second = kvxfer_late:Second\n")
        registry.refresh()
        assert registry.get_transport("late_second").name == "late_second"
        assert {"late_first", "late_second"} <= set(registry.installed_names())


def test_a_name_two_distributions_provide_is_broken_naming_both(tmp_path: Path) -> None:
    """Which of the two would load depends on the order of sys.path and of directory listings:
    neither does, and the message names both distributions."""
    for dist in ("kvxfer-twice-a", "kvxfer-twice-b"):
        _distribution(tmp_path, dist, "twice = kvxfer_twice:Twice\n")
    with _importable(tmp_path, "kvxfer_twice",
                     _TRANSPORT + "class Twice(CpuGatherTransport):\n    name = 'twice'\n    production = False\n"):
        with pytest.raises(TransportBroken, match="provided by 2 distributions") as info:
            registry.get_transport("twice")
        assert "kvxfer-twice-a 0.1" in str(info.value) and "kvxfer-twice-b 0.1" in str(info.value)
        (row,) = [p for p in registry.list_plugins() if p.name == "twice"]
        assert row.health == "broken" and "uninstall all but one" in row.detail


def test_a_plugin_named_unlike_its_entry_point_is_broken_with_the_fix_named(tmp_path: Path, caplog) -> None:
    _distribution(tmp_path, "kvxfer-misnamed", "misnamed = kvxfer_misnamed:Misnamed\n")
    with _importable(tmp_path, "kvxfer_misnamed", _TRANSPORT + "class Misnamed(CpuGatherTransport):\n    name = 'other'\n"):
        with pytest.raises(TransportBroken, match="set name = 'misnamed' on Misnamed, or rename the entry point"):
            registry.get_transport("misnamed")
        assert "names a transport called 'other'" in caplog.text  # logged once, as every broken plugin is


def test_why_a_transport_does_not_serve_a_device_is_named() -> None:
    """A probe that answers available but lists no device types serves nothing: the reason
    says so (an author following the guide otherwise hears only that the device is wrong)."""
    from kvxfer.transport import Capabilities, Probe, Transport

    class Silent(Transport):
        name = "silent"
        api_version = 2
        capabilities = Capabilities(device_types=frozenset({"cpu"}))

        def probe(self) -> Probe:
            return Probe(True, "host memory")

    class Cpu(Silent):
        def probe(self) -> Probe:
            return Probe(True, "host memory", device_types=("cpu",))

    cpu = torch.device("cpu")
    assert not Silent().serves(cpu)
    assert "Probe.device_types is empty" in (Silent().refusal(cpu) or "")
    assert Cpu().serves(cpu) and Cpu().refusal(cpu) is None
    assert "capabilities claim device types cpu" in (Cpu().refusal(torch.device("meta")) or "")


# --------------------------------------------------------------------------- a server with the plugin


@pytest.fixture(scope="module")
def hook_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hooks") / "events.jsonl"


@pytest.fixture(scope="module")
def plugin_server(on_path: Path, hook_log: Path):
    """cpu_gather and test_loop (which is not meant for production: loaded because named)."""
    srv = ServerProcess(l1_size="2MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather,test_loop",
                        env=env_with(on_path, KVXFER_TEST_HOOK_LOG=str(hook_log)))
    with srv:
        yield srv


@pytest.fixture
def loop_client(plugin_server):
    c = CacheClient(plugin_server.url, timeout=20)
    yield c
    c.close()


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def shared_kv(tmp_path: Path, name: str, num_blocks: int = 32, seed: int = 0) -> list[torch.Tensor]:
    from kvxfer_test_transport import shared_layers

    layers = shared_layers(tmp_path / name, 2, (2, num_blocks, BLOCK_SIZE, 2, 8), torch.float16)
    g = torch.Generator().manual_seed(seed)
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return layers


def fifo(tmp_path: Path, name: str) -> Path:
    """A FIFO for LoopParams' hold_until / queued_until: the server's copy waits on it."""
    path = tmp_path / name
    os.mkfifo(path)
    return path


def release(path: Path) -> None:
    """Let the server's copy waiting on ``path`` go on (it has the FIFO open for reading)."""
    fd = os.open(path, os.O_WRONLY)
    os.write(fd, b"x")
    os.close(fd)


def stored_pair(client: CacheClient, tmp_path: Path, name: str, seed: int):
    """Two test_loop contexts of model ``name`` (source, destination) and two chunks stored
    from the source: (src layers, dst layers, source ctx, destination ctx, hashes, blocks)."""
    src = shared_kv(tmp_path, f"{name}-src", seed=seed)
    dst = shared_kv(tmp_path, f"{name}-dst", seed=seed + 1)
    a = client.register(src, model_name=name, block_size=BLOCK_SIZE, transport="test_loop")
    b = client.register(dst, model_name=name, block_size=BLOCK_SIZE, transport="test_loop")
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=name)
    blocks = list(range(2 * BLOCKS_PER_CHUNK))
    assert a.submit_store(hashes, blocks).result(30).stored == [0, 1]
    return src, dst, a, b, hashes, blocks


def test_a_store_resent_after_a_restart_has_a_deadline_of_its_own(on_path: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A server-driven store that finds the server restarted (no_session) is sent again once the
    client has registered again: with the time the client waits for that reply, not the first
    send's, which passed while it registered (here a slow reconnect, 2.6 s of a 2 s timeout).
    The server stores it (it copied nothing, and called it abandoned, with the old deadline).
    A store that reaches the server past its deadline evicts nothing and reserves nothing."""
    with ServerProcess(l1_size="2MiB", chunk_size=CHUNK_SIZE, transports="test_loop", env=env_with(on_path)) as srv:
        client = CacheClient(srv.url, timeout=2.0, connect_timeout=10.0)
        try:
            kv = shared_kv(tmp_path, "resend")
            ctx = client.register(kv, model_name="resend", block_size=BLOCK_SIZE, transport="test_loop")
            first = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="resend-1")
            assert ctx.submit_store(first, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
            srv.kill()
            srv.start()
            reconnect = client.reconnect

            def slow(context: object = None) -> None:
                time.sleep(2.6)  # a busy, just restarted server; many contexts to register again
                reconnect(context)  # type: ignore[arg-type]

            monkeypatch.setattr(client, "reconnect", slow)
            again = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="resend-2")
            assert ctx.submit_store(again, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]

            # registering again took longer than two timeouts: the store ends as its caller counts
            # on (within two timeouts of its first send), and the server copies nothing of it
            srv.kill()
            srv.start()

            def slower(context: object = None) -> None:
                time.sleep(5.0)
                reconnect(context)  # type: ignore[arg-type]

            monkeypatch.setattr(client, "reconnect", slower)
            late = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="resend-3")
            fut = ctx.submit_store(late, list(range(2 * BLOCKS_PER_CHUNK)))
            try:
                assert fut.result(30).stored == []
            except RequestTimeout:
                pass  # its wait ended before the refusal came back
            monkeypatch.setattr(client, "reconnect", reconnect)
            time.sleep(1.5)  # past the slow reconnect, had the wait ended before the refusal came back
            assert client.lookup("resend", hashes=late) == 0

            # a store whose deadline passed before it reached the server, into a full arena: refused
            # before its reservation, so it evicts no chunk
            n = 0
            while client.status().arena.evictions == 0:
                n += 1
                fill = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=f"fill-{n}")
                assert ctx.submit_store(fill, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
            before = client.status().arena
            stores = [t.stores for t in client.status().traffic]
            late = m.Store(ctx.instance_id, chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="late"),
                           list(range(2 * BLOCKS_PER_CHUNK)), deadline=time.time() - 1)
            assert client.request(late) == m.StoreResult([], [], [0, 1])
            st = client.status()
            assert (st.arena.evictions, st.arena.chunks, st.reservations) == (before.evictions, before.chunks, 0)
            assert [(t.stored_chunks, t.abandoned_chunks) for t in st.traffic] == [(2 * n, 4)]
            assert [t.stores for t in st.traffic] == stores, "a store that never ran is no store, and has no duration"
        finally:
            client.close()


def test_a_server_loads_production_transports_unless_others_are_named(on_path: Path, plugin_server) -> None:
    """Without --transports: every installed production transport that can run here, none of the
    others (test_loop and the example file_debug are not meant for production), broken ones
    skipped. Named in --transports, one that is not meant for production loads, with a warning."""
    with ServerProcess(l1_size="2MiB", chunk_size=CHUNK_SIZE, env=env_with(on_path)) as srv:
        with CacheClient(srv.url) as c:
            loaded = set(c.server_transports)
        log = srv.log()
    assert "cpu_gather" in loaded
    assert not {"test_loop", "file_debug", "test_broken", "test_oldapi", "test_nodevice"} & loaded, loaded
    assert "transport test_loop not loaded: it is not meant for production" in log
    assert "transport file_debug not loaded: it is not meant for production" in log
    assert "transport test_loop is not meant for production" in plugin_server.log()
    assert "WARNING" in next(line for line in plugin_server.log().splitlines() if "test_loop is not meant" in line)


def test_server_driven_round_trip_and_hooks(loop_client, tmp_path: Path, hook_log: Path) -> None:
    src = shared_kv(tmp_path, "src", seed=1)
    dst = shared_kv(tmp_path, "dst", seed=2)
    a = loop_client.register(src, model_name="loop", block_size=BLOCK_SIZE, transport="auto")
    b = loop_client.register(dst, model_name="loop", block_size=BLOCK_SIZE, transport="test_loop")
    assert a.transport_name == "test_loop"  # auto, CPU tensors: the highest priority for cpu
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE)
    blocks = list(range(2 * BLOCKS_PER_CHUNK))
    assert a.submit_store(hashes, blocks).result(30).stored == [0, 1]
    assert b.submit_retrieve(hashes, blocks[::-1]).result(30).loaded == [0, 1]
    for s, d in zip(src, dst):
        assert torch.equal(d[:, blocks[::-1]], s[:, blocks])
    st = loop_client.status()
    assert st.sections["test-recorder"]["contexts"] == "2"
    assert {t.name: t.state for t in st.transports}["test_loop"] == {"kind": "test"}
    a.close()
    b.close()
    ev = events(hook_log)
    kinds = [e["event"] for e in ev]
    assert kinds[0] == "server_started"
    assert [e["transport"] for e in ev if e["event"] == "context_registered" and e["model"] == "loop"] == \
        ["test_loop", "test_loop"]
    # the hook's context carries the registration as sent, decoded as the transport's type
    assert [(e["registration"], e["instance"]) for e in ev if e["event"] == "context_registered"
            and e["model"] == "loop"] == [("LoopRegistration", a.instance_id), ("LoopRegistration", b.instance_id)]
    assert [e["hashes"] for e in ev if e["event"] == "chunks_stored" and e["model"] == "loop"] == \
        [[h.hex() for h in hashes]]
    assert [e["hashes"] for e in ev if e["event"] == "chunks_retrieved" and e["model"] == "loop"] == \
        [[h.hex() for h in hashes]]
    assert [e["reason"] for e in ev if e["event"] == "context_unregistered" and e["model"] == "loop"] == \
        ["unregister", "unregister"]


def test_server_driven_round_trip_of_interleaved_strided_layers(loop_client, tmp_path: Path) -> None:
    """Layers interleaved in one buffer, heads outside layers (vLLM's BHLNC order): the server
    rebuilds each layer from its registered shape, strides and offset, and moves exactly the
    blocks' pages, nothing between them."""
    from kvxfer_test_transport import shared_buffer

    layers_n, blocks, heads, content = 2, 16, 2, 8
    run = BLOCK_SIZE * content
    nbytes = blocks * heads * layers_n * run * 2
    buf = shared_buffer(tmp_path / "bhlnc", nbytes)
    buf.copy_(torch.randint(-128, 128, (nbytes,), dtype=torch.int8))
    fp16 = buf.view(torch.float16)
    views = [fp16.as_strided((blocks, heads, BLOCK_SIZE, content), (heads * layers_n * run, layers_n * run, content, 1),
                             li * run) for li in range(layers_n)]
    ctx = loop_client.register(views, model_name="strided", block_size=BLOCK_SIZE, transport="test_loop")
    assert ctx.layout.runs == heads
    before = buf.clone()
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="strided")
    src, dst = list(range(BLOCKS_PER_CHUNK)), list(range(blocks - BLOCKS_PER_CHUNK, blocks))
    assert ctx.submit_store(hashes, src).result(30).stored == [0]
    assert ctx.submit_retrieve(hashes, dst).result(30).loaded == [0]
    want = before.view(torch.float16).clone()
    for li in range(layers_n):
        ref = want.as_strided(views[li].shape, views[li].stride(), views[li].storage_offset())
        ref[dst] = ref[src].clone()
    assert torch.equal(buf, want.view(torch.int8))
    ctx.close()


def test_eviction_hook(loop_client, tmp_path: Path, hook_log: Path) -> None:
    src = shared_kv(tmp_path, "evict", num_blocks=32)
    kv = loop_client.register(src, model_name="evict", block_size=BLOCK_SIZE, transport="test_loop")
    chunk = kv.layout.chunk_bytes(CHUNK_SIZE)  # 8 KiB; the 2 MiB arena holds 256 of them
    n = (2 << 20) // chunk + 8
    hashes = chunk_hashes(list(range(n * CHUNK_SIZE)), CHUNK_SIZE, salt="evict")
    for i in range(0, n, 8):
        res = kv.submit_store(hashes[i:i + 8], [j % 32 for j in range(8 * BLOCKS_PER_CHUNK)]).result(30)
        assert res.ok
    kv.close()
    mine = {h.hex() for h in hashes}
    evicted = [h for e in events(hook_log) if e["event"] == "chunks_evicted" for h in e["hashes"] if h in mine]
    assert len(evicted) >= 1
    assert evicted == [h.hex() for h in hashes[:len(evicted)]]  # least recently used first
    assert loop_client.status().arena.evictions >= 8


def test_control_requests_run_inline_while_a_transfer_runs(loop_client, tmp_path: Path) -> None:
    from kvxfer_test_transport import LoopParams

    kv = loop_client.register(shared_kv(tmp_path, "slow"), model_name="slow", block_size=BLOCK_SIZE,
                              transport="test_loop")
    hashes = chunk_hashes(list(range(3 * CHUNK_SIZE)), CHUNK_SIZE, salt="slow")
    blocks = list(range(BLOCKS_PER_CHUNK))
    order: list[str] = []
    lock = threading.Lock()
    gate = fifo(tmp_path, "release")

    def store(i: int, params: LoopParams):
        fut = loop_client.submit(m.Store(kv.instance_id, [hashes[i]], blocks, msgspec_raw(params)))
        fut.add_done_callback(lambda f: (lock.acquire(), order.append(f"store{i}"), lock.release()))
        return fut

    held = store(0, LoopParams(hold_until=str(gate)))  # held at the server until we release it
    behind = store(1, LoopParams())  # same instance: must wait for the held one
    # control requests are answered while the held store occupies the instance's worker
    assert loop_client.ping() > 0
    assert loop_client.lookup("slow", hashes=hashes) == 0
    assert loop_client.status().sessions >= 1
    assert not held.done() and not behind.done()
    release(gate)
    assert held.result(30).stored == [0] and behind.result(30).stored == [0]
    assert order == ["store0", "store1"]
    assert loop_client.lookup("slow", hashes=hashes[:2]) == 2
    kv.close()


def test_params_of_a_request_the_client_stopped_waiting_for_are_released_as_such(on_path: Path,
                                                                                tmp_path: Path) -> None:
    """The params of a request whose answer the client stopped waiting for (the server held in
    its copy on a FIFO past the client's 1 s timeout) are released once the server answers it
    late, as done: until then the server may still copy with what they name. A request answered
    in time, or never sent (cancelled first), has them released at once."""
    from kvxfer.errors import RequestTimeout
    from kvxfer_test_transport import LoopParams

    with ServerProcess(l1_size="2MiB", chunk_size=CHUNK_SIZE, transports="test_loop", env=env_with(on_path)) as srv:
        client = CacheClient(srv.url, timeout=1.0)
        try:
            ctx = client.register(shared_kv(tmp_path, "done"), model_name="done", block_size=BLOCK_SIZE,
                                  transport="test_loop")
            hashes = chunk_hashes(list(range(3 * CHUNK_SIZE)), CHUNK_SIZE, salt="done")
            blocks = list(range(BLOCKS_PER_CHUNK))
            gate = fifo(tmp_path, "gate")
            ctx.next_store = LoopParams(hold_until=str(gate))
            with pytest.raises(RequestTimeout):
                ctx.submit_store(hashes[:1], blocks).result(30)
            assert ctx.released == [], "params released while the server still copied with them"
            release(gate)  # the server's copy ends, and its answer comes late
            assert wait_until(lambda: ctx.released == [("store", True)], 30), ctx.released
            ctx.next_store = LoopParams()
            assert ctx.submit_store(hashes[1:2], blocks).result(30).stored == [0]
            assert ctx.released[1:] == [("store", True)]
            cancelled = ctx.submit_store(hashes[2:3], blocks)
            cancelled.cancel()
            if cancelled.cancelled():  # never sent: nothing at the server uses its params
                assert wait_until(lambda: len(ctx.released) == 3, 30) and ctx.released[2] == ("store", True)
        finally:
            client.close()


def msgspec_raw(params: object):
    import msgspec

    return msgspec.Raw(codec.encode(params))


def test_a_handlers_exception_is_a_typed_error_and_the_server_keeps_serving(loop_client, tmp_path: Path) -> None:
    from kvxfer_test_transport import LoopParams

    with pytest.raises(ServerInternalError, match="transport 'test_loop' failed in open: .*exploded on purpose"):
        loop_client.register(shared_kv(tmp_path, "boom"), model_name="explode", block_size=BLOCK_SIZE,
                             transport="test_loop")
    kv = loop_client.register(shared_kv(tmp_path, "fail"), model_name="fail", block_size=BLOCK_SIZE,
                              transport="test_loop")
    kv.next_store = LoopParams(fail=True)
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="fail")
    with pytest.raises(ServerInternalError, match="transport 'test_loop' failed in store: .*failed on purpose"):
        kv.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30)
    assert loop_client.lookup("fail", hashes=hashes) == 0  # the failed slots were dropped
    traffic = [t for t in loop_client.status().traffic if t.model == "fail"]  # its chunk counted as a failed copy's
    assert [(t.stores, t.stored_chunks, t.failed_chunks) for t in traffic] == [(0, 0, 1)], traffic
    kv.next_store = LoopParams()
    assert kv.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
    kv.close()
    assert loop_client.ping() > 0


@pytest.mark.parametrize("model", ["escape", "quick-escape"])  # on the instance's worker / on the server's loop
def test_a_plugin_that_calls_sys_exit_or_raises_keyboardinterrupt_fails_its_request_only(
        loop_client, tmp_path: Path, model: str) -> None:
    """SystemExit and KeyboardInterrupt from a plugin's server code are its failure like any
    other: the request fails with a typed error naming the transport and the step, and the server
    keeps serving (they went through the core's boundary and ended the server's loop or worker)."""
    from kvxfer_test_transport import LoopParams

    kv = loop_client.register(shared_kv(tmp_path, model), model_name=model, block_size=BLOCK_SIZE,
                              transport="test_loop")
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=model)
    for escape, said in (("exit", "SystemExit: test_loop store called sys.exit"),
                         ("interrupt", "KeyboardInterrupt: test_loop store raised KeyboardInterrupt")):
        kv.next_store = LoopParams(escape=escape)
        with pytest.raises(ServerInternalError, match=f"transport 'test_loop' failed in store: {said}"):
            kv.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30)
    kv.next_store = LoopParams()
    assert kv.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
    assert loop_client.lookup(model, hashes=hashes) == 1
    kv.close()


def test_a_layerwise_retrieve_of_a_server_driven_transport_is_one_request_per_range_of_layers(
        loop_client, tmp_path: Path) -> None:
    """test_loop claims layer_ranges: a layer-wise retrieve is sent as one request per layer
    (2 layers here), each landing its layer; the second is held at the server while the test
    checks that the first layer landed and the second did not."""
    from kvxfer_test_transport import LoopParams

    assert "retrieve_layers" in loop_client.features
    src, dst, a, b, hashes, blocks = stored_pair(loop_client, tmp_path, "lw", seed=3)
    gate = fifo(tmp_path, "release-lw")
    b.next_retrieves = [LoopParams(), LoopParams(hold_until=str(gate))]
    fut = b.submit_retrieve(hashes, blocks, by_layer=True)
    fut.wait_layer(0, timeout=30)
    assert torch.equal(dst[0][:, blocks], src[0][:, blocks])
    assert not fut.layer_landed(1) and not fut.done()
    assert not torch.equal(dst[1][:, blocks], src[1][:, blocks])
    release(gate)
    assert fut.result(30).loaded == [0, 1]
    assert torch.equal(dst[1][:, blocks], src[1][:, blocks])
    assert loop_client.status().reservations == 0
    a.close()
    b.close()


def test_a_layerwise_store_of_a_server_driven_transport_is_sent_once_every_layer_is_written(
        loop_client, tmp_path: Path) -> None:
    src = shared_kv(tmp_path, "lws-src", seed=5)
    dst = shared_kv(tmp_path, "lws-dst", seed=6)
    a = loop_client.register(src, model_name="lws", block_size=BLOCK_SIZE, transport="test_loop")
    b = loop_client.register(dst, model_name="lws", block_size=BLOCK_SIZE, transport="test_loop")
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="lws")
    blocks = list(range(2 * BLOCKS_PER_CHUNK))
    fut = a.submit_store(hashes, blocks, by_layer=True)
    for i, layer in enumerate(src):
        # a store sent before its layers were written (copying the old values) would be answered
        # before a plain store submitted behind it on the same context
        probe = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt=f"lws-probe-{i}")
        assert a.submit_store(probe, list(range(4 * BLOCKS_PER_CHUNK, 5 * BLOCKS_PER_CHUNK))).result(30).stored == [0]
        assert loop_client.status().reservations == 0 and not fut.done()
        layer[:, blocks] = layer[:, blocks] * 2 + 1
        fut.layer_ready(i)
    assert fut.result(30).stored == [0, 1]
    assert b.submit_retrieve(hashes, blocks).result(30).loaded == [0, 1]
    for s, d in zip(src, dst):
        assert torch.equal(d[:, blocks], s[:, blocks])
    a.close()
    b.close()


def test_a_retrieve_of_a_bad_range_of_layers_is_refused(loop_client, tmp_path: Path) -> None:
    kv = loop_client.register(shared_kv(tmp_path, "lwbad"), model_name="lwbad", block_size=BLOCK_SIZE,
                              transport="test_loop")
    hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="lwbad")
    for span in ([1, 1], [0, 3], [0], [-1, 1]):
        with pytest.raises(InvalidRequest, match=r"layers: must be \[first, stop\)"):
            loop_client.request(m.Retrieve(kv.instance_id, hashes, list(range(BLOCKS_PER_CHUNK)), layers=span))
    assert loop_client.status().reservations == 0
    kv.close()


def test_a_hook_that_raises_is_isolated(on_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    env = env_with(on_path, KVXFER_TEST_HOOK_LOG=str(log), KVXFER_TEST_HOOK_RAISE="1")
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="test_loop", env=env) as srv:
        with CacheClient(srv.url) as c:
            kv = c.register(shared_kv(tmp_path, "iso"), model_name="iso", block_size=BLOCK_SIZE,
                            transport="test_loop")
            hashes = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE)
            assert kv.submit_store(hashes, list(range(BLOCKS_PER_CHUNK))).result(30).stored == [0]
            assert kv.submit_retrieve(hashes, list(range(BLOCKS_PER_CHUNK))).result(30).loaded == [0]
            st = c.status()
            # started, registered, stored, retrieved and this status section: all raised
            assert st.hook_errors >= 5
            assert "test-recorder" in st.sections  # the other plugin's section is still there
            kv.close()
        # the well-behaved recorder saw everything despite its raising neighbour
        kinds = {e["event"] for e in events(log)}
        assert {"server_started", "context_registered", "chunks_stored", "chunks_retrieved"} <= kinds
        assert "hook kvxfer_chunks_stored of plugin" in srv.log() and "raised on purpose" in srv.log()
    assert "server_stopped" in {e["event"] for e in events(log)}


def test_a_retrieve_whose_copies_are_queued_is_answered_before_they_end(loop_client, tmp_path: Path) -> None:
    """A server context that returns Queued (cuda_ipc, when the client gives it an event to
    record) gets its request answered at once: the client's finish_retrieve waits for the copy,
    the future resolves only after it, and the server keeps the chunks pinned until it ends."""
    from kvxfer_test_transport import LoopParams

    src, dst, a, b, hashes, blocks = stored_pair(loop_client, tmp_path, "queued", seed=7)
    gate = fifo(tmp_path, "release-queued")
    b.next_retrieves = [LoopParams(queued_until=str(gate))]
    fut = b.submit_retrieve(hashes, blocks)
    assert b.answered.wait(30)  # answered while the copy waits for the release
    assert not fut.done()
    assert not torch.equal(dst[0][:, blocks], src[0][:, blocks])
    assert loop_client.status().reservations == 1  # the chunks stay pinned until the copy ends
    release(gate)
    assert fut.result(30).loaded == [0, 1]
    for s, d in zip(src, dst):
        assert torch.equal(d[:, blocks], s[:, blocks])
    wait_until(lambda: loop_client.status().reservations == 0, timeout=30)
    assert next(c for c in loop_client.status().contexts if c.instance_id == b.instance_id).retrieves == 1
    a.close()
    b.close()


def only_in_l2(c: CacheClient, kv, model: str, hashes: list[bytes], blocks: list[int], gate: Path) -> None:
    """Store ``hashes`` through ``kv``, wait until the L2 store (``test_gated``) holds them, drop
    them from L1, and hold the store's reads (promotions) until ``gate`` is removed."""
    assert kv.submit_store(hashes, blocks).result(30).stored == list(range(len(hashes)))
    wait_until(lambda: (t := c.status().tiers[0]).writes == len(hashes) and t.queue_depth == 0, timeout=30)
    assert c.clear(model) == len(hashes)  # only L2 holds them now
    gate.touch()


def test_a_retrieve_waiting_for_l2_keeps_its_place_before_the_instances_later_transfers(
        on_path: Path, tmp_path: Path) -> None:
    """A server-driven retrieve of chunks being promoted from L2 waits at the server; a store of
    the same instance sent after it (4 requests in flight, as cuda_ipc) still runs after it, so
    it stores what the retrieve loaded into the blocks, not what they held before."""
    l2 = tmp_path / "l2"
    gate = Path(f"{l2}.gate")  # test_gated's reads (the promotion) wait while it exists
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="test_loop4", env=env_with(on_path),
                       extra_args=["--l2", "test_gated", "--l2-url", f"file://{l2}"]) as srv, \
            CacheClient(srv.url, timeout=30) as c:
        src, dst, check = (shared_kv(tmp_path, f"order-{i}", seed=11 + i) for i in range(3))
        a, b, v = (c.register(kv, model_name="order", block_size=BLOCK_SIZE, transport="test_loop4")
                   for kv in (src, dst, check))
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="order")
        later = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="order-later")
        blocks = list(range(2 * BLOCKS_PER_CHUNK))
        only_in_l2(c, a, "order", hashes, blocks, gate)
        lease = c.lookup_and_lease("order", hashes=hashes, lease_s=30, promote=True)
        assert (lease.hits, lease.l2_hits) == (2, 2)
        retrieved = b.submit_retrieve(hashes, blocks, lease_id=lease.lease_id)
        stored = b.submit_store(later, blocks)  # reads the blocks the retrieve writes
        c.ping()  # both reached the server (one connection, answered in order): the retrieve waits
        assert not retrieved.done() and not stored.done()
        gate.unlink()
        assert retrieved.result(30).loaded == [0, 1] and stored.result(30).stored == [0, 1]
        assert v.submit_retrieve(later, blocks).result(30).loaded == [0, 1]
        for s_layer, v_layer in zip(src, check):
            assert torch.equal(v_layer[:, blocks], s_layer[:, blocks]), "the store ran before the retrieve"
        for kv in (a, b, v):
            kv.close()


def test_promotions_held_at_the_store_do_not_use_up_the_reservations_stores_need(on_path: Path, tmp_path: Path) -> None:
    """Promotions from L2 are the tier's reservations, bounded by the arena: however many one
    client's lookups keep running (held here at the store), they do not count against
    --max-reservations, so every client's stores still get theirs (a burst of promoting lookups
    once made other clients' stores fail with limit_exceeded)."""
    l2 = tmp_path / "l2"
    gate = Path(f"{l2}.gate")  # test_gated's reads (the promotions) wait while it exists
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather", env=env_with(on_path),
                       extra_args=["--l2", "test_gated", "--l2-url", f"file://{l2}", "--max-reservations", "2"]) as srv, \
            CacheClient(srv.url, timeout=30) as c:
        kv = flash_attn_kv(num_layers=2, num_blocks=64, seed=31)
        ctx = c.register(kv, model_name="burst", block_size=BLOCK_SIZE, transport="cpu_gather")
        hashes = chunk_hashes(list(range(4 * CHUNK_SIZE)), CHUNK_SIZE, salt="burst")
        only_in_l2(c, ctx, "burst", hashes, list(range(4 * BLOCKS_PER_CHUNK)), gate)
        try:
            for h in hashes:  # one promotion each, no lease: each a reservation of the tier's, held
                assert c.lookup("burst", hashes=[h], promote=True) == 1
            assert c.status().tiers[0].promoting == 4
            later = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="burst-later")
            assert ctx.submit_store(later, list(range(2 * BLOCKS_PER_CHUNK))).result(30).stored == [0, 1]
        finally:
            gate.unlink()
        assert wait_until(lambda: c.status().tiers[0].promoting == 0, timeout=30)
        ctx.close()


def test_a_retrieve_whose_instance_is_unregistered_while_it_waits_for_l2_pins_nothing(
        on_path: Path, tmp_path: Path) -> None:
    """A retrieve waiting for chunks promoted from L2 whose instance is unregistered meanwhile
    (by a request queued before it) fails once the promotion ends, even if the instance id was
    registered again: it reads nothing for the new registration, and the chunks it would have
    read are not left pinned (clear() removes them)."""
    from kvxfer_test_transport import LoopParams

    l2 = tmp_path / "l2"
    gate = Path(f"{l2}.gate")  # test_gated's reads (the promotion) wait while it exists
    held = fifo(tmp_path, "held")
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="test_loop4", env=env_with(on_path),
                       extra_args=["--l2", "test_gated", "--l2-url", f"file://{l2}"]) as srv, \
            CacheClient(srv.url, timeout=30) as c:
        src, dst = (shared_kv(tmp_path, f"gone-{i}", seed=21 + i) for i in range(2))
        a, b = (c.register(kv, model_name="gone", block_size=BLOCK_SIZE, transport="test_loop4") for kv in (src, dst))
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="gone")
        other = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="gone-other")
        blocks = list(range(2 * BLOCKS_PER_CHUNK))
        only_in_l2(c, a, "gone", hashes, blocks, gate)
        assert c.lookup("gone", hashes=hashes, promote=True) == 2
        # the instance's lane: a store held at the server, the unregister, then the retrieve
        store = c.submit(m.Store(b.instance_id, other, blocks[:BLOCKS_PER_CHUNK],
                                 msgspec_raw(LoopParams(hold_until=str(held)))))
        unregister = c.submit(m.Unregister(b.instance_id))
        retrieve = c.submit(m.Retrieve(b.instance_id, hashes, blocks))
        c.ping()  # all three reached the server (one connection, answered in order)
        assert not retrieve.done() and not unregister.done()
        release(held)
        assert store.result(30).stored == [0]
        unregister.result(30)
        b.register()  # the same instance id, registered again while the retrieve still waits
        gate.unlink()
        with pytest.raises(UnknownInstance, match="unregistered"):
            retrieve.result(30)
        assert c.status().reservations == 0
        wait_until(lambda: (t := c.status().tiers[0]).writes == 3 and t.queue_depth == 0, timeout=30)
        assert c.clear("gone") == 3, "the retrieve of the old registration left its chunks pinned"
        for kv in (a, b):
            kv.close()


def test_requests_waiting_on_l2_are_bounded_per_session(on_path: Path, tmp_path: Path) -> None:
    """Retrieves of chunks being promoted and lookups that ask L2 count against
    --max-waiting-per-session while they wait: one past it is refused with a message naming the
    limit, nothing of it done; another session still waits; once the promotion ends the count
    is back to zero."""
    l2 = tmp_path / "l2"
    gate = Path(f"{l2}.gate")  # test_gated's reads (the promotion) wait while it exists
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="test_loop4", env=env_with(on_path),
                       extra_args=["--l2", "test_gated", "--l2-url", f"file://{l2}",
                                   "--max-waiting-per-session", "2"]) as srv, \
            CacheClient(srv.url, timeout=30) as c, CacheClient(srv.url, timeout=30) as other:
        src, dst = (shared_kv(tmp_path, f"wait-{i}", seed=31 + i) for i in range(2))
        a = c.register(src, model_name="wait", block_size=BLOCK_SIZE, transport="test_loop4")
        b = c.register(dst, model_name="wait", block_size=BLOCK_SIZE, transport="test_loop4")
        ob = other.register(dst, model_name="wait", block_size=BLOCK_SIZE, transport="test_loop4")
        hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="wait")
        absent = chunk_hashes(list(range(CHUNK_SIZE)), CHUNK_SIZE, salt="wait-absent")
        blocks = list(range(2 * BLOCKS_PER_CHUNK))
        only_in_l2(c, a, "wait", hashes, blocks, gate)
        assert c.lookup("wait", hashes=hashes, promote=True) == 2
        waiting = [b.submit_retrieve(hashes, blocks) for _ in range(2)]
        c.ping()  # both reached the server (one connection, answered in order) and wait
        assert not any(f.done() for f in waiting)
        with pytest.raises(LimitExceeded, match="max_waiting_per_session.*--max-waiting-per-session"):
            b.submit_retrieve(hashes, blocks).result(30)
        with pytest.raises(LimitExceeded, match="max_waiting_per_session"):
            c.lookup("wait", hashes=absent)  # it would ask L2
        theirs = ob.submit_retrieve(hashes, blocks)  # another session's count is its own
        other.ping()
        assert not theirs.done()
        gate.unlink()
        assert [f.result(30).loaded for f in waiting] == [[0, 1], [0, 1]]
        assert theirs.result(30).loaded == [0, 1]
        assert c.lookup("wait", hashes=absent) == 0  # the session waits on L2 again
        assert b.submit_retrieve(hashes, blocks).result(30).loaded == [0, 1]
        for kv in (a, b, ob):
            kv.close()


def test_a_lone_request_of_a_context_that_only_queues_copies_runs_on_the_servers_loop(
        loop_client, tmp_path: Path) -> None:
    """A server context that declares queues_only has a lone request's copy called on the
    server's loop thread (no hand-off to the worker); others, on the instance's worker."""
    src = shared_kv(tmp_path, "quick-src", seed=9)
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="quick")
    blocks = list(range(2 * BLOCKS_PER_CHUNK))
    for model in ("quick", "slowpath"):
        kv = loop_client.register(src, model_name=model, block_size=BLOCK_SIZE, transport="test_loop")
        assert kv.submit_store(hashes, blocks).result(30).stored == [0, 1]
        assert kv.submit_retrieve(hashes, blocks).result(30).loaded == [0, 1]
        kv.close()
    threads: dict[str, dict[str, float]] = {}
    for s in loop_client.status().plugin_metrics:
        if s.name == "kvxfer_test_loop_copy_threads_total":
            threads.setdefault(s.labels["model"], {})[s.labels["thread"]] = s.value
    assert sum(threads["quick"].values()) == 2 and sum(threads["slowpath"].values()) == 2
    assert all(t.startswith("kvxfer-worker") for t in threads["slowpath"])
    assert not any(t.startswith("kvxfer-worker") for t in threads["quick"])


def loop_metric(client: CacheClient, name: str, model: str) -> float:
    """A test_loop metric's value for ``model`` (0 while absent)."""
    return sum(s.value for s in client.status().plugin_metrics
               if s.name == name and s.labels.get("model") == model)


def test_a_server_context_whose_queues_only_raises_still_has_its_requests_served(
        loop_client, tmp_path: Path) -> None:
    """queues_only is the plugin's code, read on the server's loop: when it raises, the request
    goes to the instance's worker as usual (the error is logged), and the loop keeps serving."""
    src = shared_kv(tmp_path, "quickraise-src", seed=11)
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt="quickraise")
    blocks = list(range(2 * BLOCKS_PER_CHUNK))
    kv = loop_client.register(src, model_name="quickraise", block_size=BLOCK_SIZE, transport="test_loop")
    assert kv.submit_store(hashes, blocks).result(30).stored == [0, 1]
    assert kv.submit_retrieve(hashes, blocks).result(30).loaded == [0, 1]
    kv.close()
    assert loop_client.ping() > 0
    threads = [s.labels["thread"] for s in loop_client.status().plugin_metrics
               if s.name == "kvxfer_test_loop_copy_threads_total" and s.labels["model"] == "quickraise"]
    assert threads and all(t.startswith("kvxfer-worker") for t in threads)


def test_a_server_context_is_closed_only_after_its_queued_copies_end(loop_client, tmp_path: Path) -> None:
    """An unregister that arrives while a retrieve answered early (Queued) still copies: the
    server drops the registration at once, but closes its server context only once the copy
    has ended (its chunks stay pinned until then)."""
    from kvxfer_test_transport import LoopParams

    src, dst, a, b, hashes, blocks = stored_pair(loop_client, tmp_path, "queued-close", seed=13)
    gate = fifo(tmp_path, "release-queued-close")
    b.next_retrieves = [LoopParams(queued_until=str(gate))]
    fut = b.submit_retrieve(hashes, blocks)
    assert b.answered.wait(30)
    loop_client.request(m.Unregister(b.instance_id))  # the copy has not run yet
    assert loop_client.status().reservations == 1
    release(gate)
    assert fut.result(30).loaded == [0, 1]
    for s, d in zip(src, dst):
        assert torch.equal(d[:, blocks], s[:, blocks])
    wait_until(lambda: loop_metric(loop_client, "kvxfer_test_loop_closed_total", "queued-close") == 1, timeout=30)
    assert loop_metric(loop_client, "kvxfer_test_loop_copies_after_close_total", "queued-close") == 0
    wait_until(lambda: loop_client.status().reservations == 0, timeout=30)
    a.close()
    b.close()


def test_a_queued_copy_that_fails_after_the_answer_is_logged_once_and_unpins(
        loop_client, plugin_server, tmp_path: Path) -> None:
    """A Queued copy that raises after its request was answered cannot fail the request any
    more: the server logs the failure once, as such (not as a failure of its own bookkeeping),
    and still unpins the chunks."""
    from kvxfer_test_transport import LoopParams

    src, dst, a, b, hashes, blocks = stored_pair(loop_client, tmp_path, "queued-fail", seed=15)
    gate = fifo(tmp_path, "release-queued-fail")
    b.next_retrieves = [LoopParams(queued_until=str(gate), fail=True)]
    fut = b.submit_retrieve(hashes, blocks)
    assert b.answered.wait(30)
    release(gate)
    assert fut.result(30).loaded == [0, 1]  # told before the copy failed
    wait_until(lambda: loop_client.status().reservations == 0, timeout=30)
    wait_until(lambda: "queued copy failed on purpose" in plugin_server.log(), timeout=30)
    log = plugin_server.log()
    assert log.count("copies failed after the request was answered") == 1
    assert "finishing a request answered before its copies ended failed" not in log
    a.close()
    b.close()


# --------------------------------------------------------------------------- prefetch at lookup


def _prefetch_figures(client: CacheClient, model: str) -> tuple[float, float]:
    """(chunks prefetched, retrieved copies served from what was prefetched) of ``model``."""
    return (loop_metric(client, "kvxfer_test_loop_prefetched_total", model),
            loop_metric(client, "kvxfer_test_loop_prefetch_hits_total", model))


def _stored_then_alone(client: CacheClient, tmp_path: Path, model: str, seed: int):
    """Two chunks of ``model`` stored from one test_loop instance, which is then closed, and the
    instance that will load them registered alone: (source layers, its layers, its context,
    hashes, blocks)."""
    src = shared_kv(tmp_path, f"{model}-src", seed=seed)
    hashes = chunk_hashes(list(range(2 * CHUNK_SIZE)), CHUNK_SIZE, salt=model)
    blocks = list(range(2 * BLOCKS_PER_CHUNK))
    a = client.register(src, model_name=model, block_size=BLOCK_SIZE, transport="test_loop")
    assert a.submit_store(hashes, blocks).result(30).stored == [0, 1]
    a.close()
    dst = shared_kv(tmp_path, f"{model}-dst", seed=seed + 1)
    b = client.register(dst, model_name=model, block_size=BLOCK_SIZE, transport="test_loop")
    return src, dst, b, hashes, blocks


def _load_reversed(ctx, src: list[torch.Tensor], dst: list[torch.Tensor], hashes: list[bytes], blocks: list[int],
                   lease_id: int) -> None:
    """Retrieve ``hashes`` through ``ctx`` into ``blocks`` reversed, and check the bytes against
    the source's ``blocks``."""
    into = blocks[::-1]
    assert ctx.submit_retrieve(hashes, into, lease_id=lease_id).result(30).loaded == [0, 1]
    for s, d in zip(src, dst):
        assert torch.equal(d[:, into], s[:, blocks])


def test_a_lookup_that_asks_for_a_prefetch_hands_the_leased_chunks_to_the_instance_that_loads_them(
        loop_client, tmp_path: Path) -> None:
    """Lookup.prefetch: once its reply is out, the server gives the leased chunks (each one's
    arena slot and stamp) to the server context of the model's one instance of that rank; the
    retrieve's copies carry the same stamps, so the context loads what it kept (test_loop
    copies from its own copy: a wrong stamp would load wrong bytes). Without prefetch, nothing."""
    model = "quick-prefetch"
    src, dst, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=21)
    plain = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30)
    assert _prefetch_figures(loop_client, model) == (0, 0)
    loop_client.release_lease(plain.lease_id)
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert reply.hits == 2 and reply.lease_id
    assert _prefetch_figures(loop_client, model) == (2, 0)
    _load_reversed(b, src, dst, hashes, blocks, reply.lease_id)
    assert _prefetch_figures(loop_client, model) == (2, 2)
    # a retrieve that skips into the first chunk copies part of it: never from what was kept
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert b.submit_retrieve(hashes, blocks, skip_first_n_tokens=BLOCK_SIZE,
                             lease_id=reply.lease_id).result(30).loaded == [0, 1]
    assert _prefetch_figures(loop_client, model) == (4, 3)
    for s, d in zip(src, dst):  # the skipped block keeps what the retrieve before put there
        assert torch.equal(d[:, blocks[1:]], s[:, blocks[1:]])
    b.close()


def test_a_prefetched_chunk_dropped_and_stored_again_is_loaded_from_its_new_bytes(
        loop_client, tmp_path: Path) -> None:
    """A stamp names one stored chunk's bytes for the server's life: the same hashes stored
    again after a clear (other bytes, in slots the old ones may have had) are loaded as stored
    now, not as prefetched before."""
    model = "quick-restamp"
    _, dst, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=31)
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert _prefetch_figures(loop_client, model) == (2, 0)
    loop_client.release_lease(reply.lease_id)
    assert loop_client.clear(model) == 2
    new = shared_kv(tmp_path, f"{model}-new", seed=33)
    a = loop_client.register(new, model_name=model, block_size=BLOCK_SIZE, transport="test_loop")
    assert a.submit_store(hashes, blocks).result(30).stored == [0, 1]
    a.close()
    into = blocks[::-1]
    assert b.submit_retrieve(hashes, into).result(30).loaded == [0, 1]
    for s, d in zip(new, dst):
        assert torch.equal(d[:, into], s[:, blocks])
    # the lone retrieve staged its own chunks (their new stamps) and loaded those, not the old
    assert _prefetch_figures(loop_client, model) == (4, 2)
    b.close()


def test_a_prefetch_is_given_the_first_max_prefetch_chunks_of_a_longer_lease(loop_client, tmp_path: Path) -> None:
    """However many chunks a lookup leases (up to hundreds of thousands), the server context
    is given the first MAX_PREFETCH_CHUNKS: each one costs the server's loop a slot view, and
    no staging holds more; the retrieve loads them all, the first ones from what was kept."""
    from kvxfer.copies import MAX_PREFETCH_CHUNKS

    model = "quick-many-prefetch"
    n = MAX_PREFETCH_CHUNKS + 3
    hashes = chunk_hashes(list(range(n * CHUNK_SIZE)), CHUNK_SIZE, salt=model)
    blocks = list(range(n * BLOCKS_PER_CHUNK))
    src = shared_kv(tmp_path, f"{model}-src", num_blocks=len(blocks), seed=51)
    a = loop_client.register(src, model_name=model, block_size=BLOCK_SIZE, transport="test_loop")
    assert a.submit_store(hashes, blocks).result(30).stored == list(range(n))
    a.close()
    dst = shared_kv(tmp_path, f"{model}-dst", num_blocks=len(blocks), seed=52)
    b = loop_client.register(dst, model_name=model, block_size=BLOCK_SIZE, transport="test_loop")
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert reply.hits == n
    assert _prefetch_figures(loop_client, model) == (MAX_PREFETCH_CHUNKS, 0)
    assert b.submit_retrieve(hashes, blocks, lease_id=reply.lease_id).result(30).loaded == list(range(n))
    for s, d in zip(src, dst):
        assert torch.equal(d, s)
    assert _prefetch_figures(loop_client, model) == (MAX_PREFETCH_CHUNKS, MAX_PREFETCH_CHUNKS)
    b.close()


def test_a_lone_retrieve_stages_its_whole_chunks_before_planning_its_copies(loop_client, tmp_path: Path) -> None:
    """A retrieve that finds nothing else in flight hands its whole chunks to its context's
    prefetch before its copies are planned (a transport's first DMA then starts at once): with
    no lookup before it, it loads both chunks from what it staged. One that skips into its first
    chunk stages the whole chunks after it only; chunks a lookup's prefetch staged are handed
    again and kept, not copied again; a retrieve layer by layer stages nothing (its copies move
    parts of chunks)."""
    model = "quick-lone-stage"
    src, dst, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=71)
    _load_reversed(b, src, dst, hashes, blocks, 0)
    assert _prefetch_figures(loop_client, model) == (2, 2)
    assert b.submit_retrieve(hashes, blocks, skip_first_n_tokens=BLOCK_SIZE).result(30).loaded == [0, 1]
    assert _prefetch_figures(loop_client, model) == (3, 3)
    for s, d in zip(src, dst):
        assert torch.equal(d[:, blocks[1:]], s[:, blocks[1:]])
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert _prefetch_figures(loop_client, model) == (5, 3)
    _load_reversed(b, src, dst, hashes, blocks, reply.lease_id)
    assert _prefetch_figures(loop_client, model) == (5, 5)
    assert b.submit_retrieve(hashes, blocks, by_layer=True).result(30).loaded == [0, 1]
    assert _prefetch_figures(loop_client, model) == (5, 5)
    b.close()


def test_a_lone_retrieve_of_a_prefetched_lease_stages_what_is_no_longer_staged(loop_client, tmp_path: Path) -> None:
    """The core cannot tell whether a lookup's prefetch staged anything (cuda_ipc queues nothing
    while its copy stream runs) or whether a transfer since took it: the lone retrieve of that
    lease is staged like any other. Here another retrieve took what the lookup's prefetch
    staged; the lease's retrieve then stages its chunks again and loads them from there."""
    model = "quick-lease-restage"
    src, dst, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=91)
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert _prefetch_figures(loop_client, model) == (2, 0)
    _load_reversed(b, src, dst, hashes, blocks, 0)  # takes what the lookup's prefetch staged
    assert _prefetch_figures(loop_client, model) == (2, 2)
    _load_reversed(b, src, dst, hashes, blocks, reply.lease_id)
    assert _prefetch_figures(loop_client, model) == (4, 4)
    b.close()


def test_a_lone_retrieve_past_its_deadline_stages_nothing(loop_client, tmp_path: Path) -> None:
    """A retrieve that comes past its deadline copies nothing (its client stopped waiting): its
    chunks are not staged either, so no DMA is queued for bytes nobody loads."""
    model = "quick-late-stage"
    _, _, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=95)
    late = loop_client.submit(m.Retrieve(b.instance_id, hashes, blocks, deadline=time.time() - 60)).result(30)
    assert late.loaded == [] and late.missing == [0, 1]
    assert _prefetch_figures(loop_client, model) == (0, 0)
    b.close()


def test_a_lone_retrieve_refused_after_staging_reserves_nothing_and_misleads_no_load(
        loop_client, tmp_path: Path) -> None:
    """A lone retrieve stages its chunks before it is checked. One refused then (a block id out
    of range) holds no pin and no reservation: its chunks can be cleared at once. Its staging
    misleads no later load: the same hashes stored again (new bytes, new stamps) load as stored
    now, and the chunks it staged are not used for them."""
    model = "quick-refused-stage"
    _, dst, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=97)
    with pytest.raises(InvalidRequest, match="block ids must be in"):
        loop_client.submit(m.Retrieve(b.instance_id, hashes, [10**6] * len(blocks))).result(30)
    assert _prefetch_figures(loop_client, model) == (2, 0)  # staged, then refused
    assert loop_client.status().reservations == 0
    assert loop_client.clear(model) == 2  # nothing pins them
    new = shared_kv(tmp_path, f"{model}-new", seed=99)
    a = loop_client.register(new, model_name=model, block_size=BLOCK_SIZE, transport="test_loop")
    assert a.submit_store(hashes, blocks).result(30).stored == [0, 1]
    a.close()
    _load_reversed(b, new, dst, hashes, blocks, 0)
    assert _prefetch_figures(loop_client, model) == (4, 2)  # its own staging of the new stamps
    b.close()


def test_a_retrieve_behind_another_transfer_stages_nothing_ahead(loop_client, tmp_path: Path) -> None:
    """With another transfer in flight (here a store of another model, held at the server) the
    copy engines are that transfer's: a retrieve plans and copies as it comes, from the arena."""
    from kvxfer_test_transport import LoopParams

    model = "quick-behind"
    src, dst, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=81)
    busy = loop_client.register(shared_kv(tmp_path, "busy-behind"), model_name="busy-behind",
                                block_size=BLOCK_SIZE, transport="test_loop")
    gate = fifo(tmp_path, "behind-busy")
    held = loop_client.submit(m.Store(busy.instance_id, [b"\x08" * 16], list(range(BLOCKS_PER_CHUNK)),
                                      msgspec_raw(LoopParams(hold_until=str(gate)))))
    _load_reversed(b, src, dst, hashes, blocks, 0)
    assert _prefetch_figures(loop_client, model) == (0, 0)
    release(gate)
    assert held.result(30).stored == [0]
    busy.close()
    b.close()


def test_a_prefetch_that_raises_is_logged_and_the_lookup_and_load_go_on(loop_client, plugin_server,
                                                                         tmp_path: Path) -> None:
    """The hook is plugin code run on the server's loop after the reply: what it raises is
    logged with the transport's name, the lookup was answered, and the load copies as usual."""
    model = "quick-prefetchraise"
    src, dst, b, hashes, blocks = _stored_then_alone(loop_client, tmp_path, model, seed=61)
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert reply.hits == 2 and reply.lease_id
    assert loop_client.ping() > 0  # the loop is alive
    _load_reversed(b, src, dst, hashes, blocks, reply.lease_id)
    assert _prefetch_figures(loop_client, model) == (0, 0)
    log = plugin_server.log()
    assert "transport test_loop: prefetching 2 chunks for instance" in log and "raised on purpose" in log
    b.close()


def test_nothing_is_prefetched_where_the_server_cannot_tell_who_loads_or_is_busy(
        loop_client, tmp_path: Path) -> None:
    """No prefetch with two registered instances of the model's rank (which one loads?), or
    while a transfer is in flight; the lookups are answered as usual. A context whose copies
    run on its worker (not queues_only) is prefetched all the same, and its retrieve, on the
    worker, loads what it kept."""
    from kvxfer_test_transport import LoopParams

    model = "quick-ambiguous"
    _, _, b, hashes, _ = _stored_then_alone(loop_client, tmp_path, model, seed=41)
    other = loop_client.register(shared_kv(tmp_path, f"{model}-other"), model_name=model, block_size=BLOCK_SIZE,
                                 transport="test_loop")
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert reply.hits == 2
    assert _prefetch_figures(loop_client, model) == (0, 0)
    loop_client.release_lease(reply.lease_id)
    other.close()

    slow = "slow-prefetch"
    ssrc, sdst, c, shashes, sblocks = _stored_then_alone(loop_client, tmp_path, slow, seed=43)
    reply = loop_client.lookup_and_lease(slow, 1, hashes=shashes, lease_s=30, prefetch=True)
    assert reply.hits == 2
    assert _prefetch_figures(loop_client, slow) == (2, 0)
    _load_reversed(c, ssrc, sdst, shashes, sblocks, reply.lease_id)
    assert _prefetch_figures(loop_client, slow) == (2, 2)
    c.close()

    # a store of another model held at the server (on its instance's worker: not a quick one)
    busy = loop_client.register(shared_kv(tmp_path, "busy-prefetch"), model_name="busy-prefetch",
                                block_size=BLOCK_SIZE, transport="test_loop")
    gate = fifo(tmp_path, "prefetch-busy")
    held = loop_client.submit(m.Store(busy.instance_id, [b"\x07" * 16], list(range(BLOCKS_PER_CHUNK)),
                                      msgspec_raw(LoopParams(hold_until=str(gate)))))
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert reply.hits == 2
    assert _prefetch_figures(loop_client, model) == (0, 0)
    release(gate)
    assert held.result(30).stored == [0]
    loop_client.release_lease(reply.lease_id)
    reply = loop_client.lookup_and_lease(model, 1, hashes=hashes, lease_s=30, prefetch=True)
    assert _prefetch_figures(loop_client, model) == (2, 0)  # idle again
    loop_client.release_lease(reply.lease_id)
    busy.close()
    b.close()


def test_hooks_see_the_server_stop(plugin_server, hook_log: Path) -> None:
    # last test of the module on this server: stop it and look for the hook
    plugin_server.stop()
    assert wait_until(lambda: "server_stopped" in {e["event"] for e in events(hook_log)}, timeout=10)


_KIT_USAGE = '''
from kvxfer.testing import TransportConformance


class TestNamesNone(TransportConformance):  # forgot `transport = ...`
    pass


class TestCannotRunHere(TransportConformance):  # its probe says it cannot run here
    transport = "test_nodevice"
'''


def test_the_kit_fails_when_it_names_no_transport_and_when_asked_to_test_one_that_cannot_run(
        test_plugin_path: Path, tmp_path: Path) -> None:
    """A kit class that names no transport (and no --kvxfer-transport) fails: it skipped every
    test, so a CI job that forgot the name passed. One whose transport cannot run here is
    skipped, or fails with --kvxfer-require-available (a job that must test it)."""
    (tmp_path / "test_usage.py").write_text(_KIT_USAGE)

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "test_usage.py",
                               "-k", "test_register_shows_in_status", *extra], capture_output=True, text=True,
                              timeout=300, env=env_with(test_plugin_path), cwd=tmp_path)

    out = run()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 skipped" in out.stdout and "1 error in" in out.stdout, out.stdout  # an error of the kit's fixture
    assert "ERROR test_usage.py::TestNamesNone" in out.stdout and "no transport under test" in out.stdout, out.stdout
    assert "SKIPPED" in out.stdout and "transport 'test_nodevice' cannot run here" in out.stdout, out.stdout
    out = run("--kvxfer-require-available")
    assert out.returncode == 1 and "2 errors in" in out.stdout and "skipped" not in out.stdout, out.stdout
    assert "ERROR test_usage.py::TestCannotRunHere" in out.stdout, out.stdout
