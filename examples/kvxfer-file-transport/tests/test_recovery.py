"""file_debug after what a real deployment meets: a server that restarted, a session the server
ended while the engine's process was stopped, and requests the client stopped waiting for (the
server may still be copying with their spool files: no other request gets one of those)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from kvxfer import CacheClient, chunk_hashes
from kvxfer.errors import RequestTimeout
from kvxfer.testing.server import ServerProcess
from kvxfer.transport import Transfer
from kvxfer_file_transport import FileContext, FileParams

CHUNK, BS = 64, 16
BPC = CHUNK // BS


def _kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 32, BS, 2, 8, generator=g) for _ in range(2)]


def _blocks(n: int, first: int = 0) -> list[int]:
    return list(range(first, first + n * BPC))


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK, transports="file_debug,cpu_gather",
                       extra_args=["--session-timeout", "2"]) as srv:
        yield srv


def test_a_context_stores_and_loads_again_after_the_server_restarted(server: ServerProcess) -> None:
    """A store is the first request after the restart: its spool file goes to the new server's
    directory (the client opens its session again and registers the context, as a reply of
    no_session would have it), and the chunks load back exact."""
    client = CacheClient(server.url, timeout=10, connect_timeout=15)
    try:
        kv = _kv(1)
        ctx = client.register(kv, model_name="restart", block_size=BS, transport="file_debug")
        keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="restart")
        assert ctx.submit_store(keys, _blocks(2)).result(30).stored == [0, 1]
        server.kill()
        server.start()
        for n in range(3):  # stores only, as an engine that only prefills
            again = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt=f"restart-{n}")
            assert ctx.submit_store(again, _blocks(2, 8)).result(30).stored == [0, 1]
        out = [torch.zeros_like(t) for t in kv]
        back = client.register(out, model_name="restart", block_size=BS, transport="file_debug")
        assert back.submit_retrieve(again, _blocks(2, 16)).result(30).loaded == [0, 1]
        for a, b in zip(kv, out):
            assert torch.equal(a[:, 8:16], b[:, 16:24])
    finally:
        client.close()


_STOPPED_CLIENT = textwrap.dedent("""
    import sys, torch
    from kvxfer import CacheClient, chunk_hashes
    url, chunk, bs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kv = [torch.randn(2, 32, bs, 2, 8, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    client = CacheClient(url, timeout=10, connect_timeout=15)
    ctx = client.register(kv, model_name="stopped", block_size=bs, transport="file_debug")
    bpc = chunk // bs
    first = chunk_hashes(list(range(chunk)), chunk, salt="first")
    assert ctx.submit_store(first, list(range(bpc))).result(30).stored == [0]
    print("ready", flush=True)
    sys.stdin.readline()  # the test stopped this process past the session timeout, and let it go on
    then = chunk_hashes(list(range(chunk)), chunk, salt="then")
    stored = ctx.submit_store(then, list(range(bpc, 2 * bpc))).result(30).stored
    out = [torch.zeros_like(t) for t in kv]
    loaded = ctx.submit_retrieve(then, list(range(2 * bpc, 3 * bpc))).result(30).loaded
    exact = all(torch.equal(t[:, bpc:2 * bpc], t[:, 2 * bpc:3 * bpc]) for t in kv)
    print("done", stored, loaded, exact, flush=True)
    client.close()
""")


def test_a_context_works_again_after_the_server_ended_its_session(server: ServerProcess) -> None:
    """The engine's process stopped past the session timeout (a debugger, swap, a frozen
    cgroup): the server ends the session and removes the registration's spool directory; the
    client registers again under the same id, and the server makes a new directory at the same
    path. The context uses the new one (it kept the old one's descriptor, and failed for good)."""
    child = subprocess.Popen([sys.executable, "-c", _STOPPED_CLIENT, server.url, str(CHUNK), str(BS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        with CacheClient(server.url) as watcher:
            end = time.monotonic() + 30.0
            while any(c.model_name == "stopped" for c in watcher.status().contexts):
                assert time.monotonic() < end, "the stopped client's session was never ended"
                time.sleep(0.1)
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["done", "[0]", "[0]", "True"]
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(10)


def test_a_spool_file_the_server_may_still_use_goes_to_no_other_request(server: ServerProcess) -> None:
    """A request whose answer the client stopped waiting for (the server stalled) keeps its spool
    file until the server answers it late: the server, stalled in its copy, may still write or
    read that file, and another request's bytes would end up in the cache under this one's keys
    (the next request took it at once). Once the late answers come, the files are free again."""
    client = CacheClient(server.url, timeout=1.0, connect_timeout=10.0)
    try:
        kv = _kv(4)
        ctx = client.register(kv, model_name="slots", block_size=BS, transport="file_debug")
        assert isinstance(ctx, FileContext)
        keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="slots")
        assert ctx.submit_store(keys, _blocks(2)).result(30).stored == [0, 1]
        seen: list[int] = []
        prepare = ctx.prepare

        def noting(transfer: Transfer) -> FileParams:
            params = prepare(transfer)
            seen.append(params.slot)
            return params

        ctx.prepare = noting  # type: ignore[method-assign]  # observes, changes nothing
        os.kill(server.pid, signal.SIGSTOP)
        try:
            for _ in range(2):
                with pytest.raises(RequestTimeout):
                    ctx.submit_retrieve(keys, _blocks(2, 8)).result(30)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert seen == [0, 1], "a spool file the stalled server may still use went to the next request"
        end = time.monotonic() + 30
        while ctx._held:  # the late answers free them
            assert time.monotonic() < end, f"spool files never freed: {ctx._held}"
            time.sleep(0.05)
        assert ctx.submit_retrieve(keys, _blocks(2, 8)).result(30).loaded == [0, 1]
        assert seen[-1] == 0
        for a in kv:
            assert torch.equal(a[:, :8], a[:, 8:16])
    finally:
        client.close()


def test_a_layerwise_retrieve_that_failed_sends_none_of_its_later_parts(server: ServerProcess) -> None:
    """A layer-wise retrieve goes as one request per group of layers (8 here, 2 at the server at
    once). Once one part has failed (the server stalled: it timed out), the parts not sent yet
    are not sent: each would wait out a timeout of its own against the stalled server and hold
    a spool file meanwhile, and the transfer, which has failed already, would end only after
    all of them (all 8 spool files were held, and the next request found none)."""
    client = CacheClient(server.url, timeout=1.0, connect_timeout=10.0)
    try:
        g = torch.Generator().manual_seed(5)
        kv = [torch.randn(2, 32, BS, 2, 8, generator=g) for _ in range(8)]
        ctx = client.register(kv, model_name="parts", block_size=BS, transport="file_debug")
        assert isinstance(ctx, FileContext)
        keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt="parts")
        assert ctx.submit_store(keys, _blocks(2)).result(30).stored == [0, 1]
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RequestTimeout):
                ctx.submit_retrieve(keys, _blocks(2, 8), by_layer=True).result(30)
            # the parts sent keep their spool files until the stalled server answers them late:
            # the two at the server when the first failed, and at most one that started meanwhile
            sent = len(ctx._held)
            assert 1 <= sent <= 3, f"{sent} of the 8 parts were sent"
            with pytest.raises(RequestTimeout):  # a spool file was free for it
                ctx.submit_retrieve(keys, _blocks(2, 8)).result(30)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert ctx.submit_retrieve(keys, _blocks(2, 8), by_layer=True).result(30).loaded == [0, 1]
        for a in kv:
            assert torch.equal(a[:, :8], a[:, 8:16])
    finally:
        client.close()
