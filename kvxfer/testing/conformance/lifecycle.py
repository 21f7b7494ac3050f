"""Conformance: close and cleanup, a client process that dies, several instances at once."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvxfer.errors import KvxferError
from kvxfer.protocol.messages import RetrieveResult
from kvxfer.testing.conformance.roundtrip import assert_retrieved
from kvxfer.testing.harness import TIMEOUT, Kit
from kvxfer.testing.kvdata import as_bytes
from kvxfer.transport.contract import TransferContext

__all__ = ["LifecycleTests"]

#: How long the server may take to drop a dead client's registrations (its session timeout is
#: 3 s in the kit's server; the rest is slack for a loaded machine).
DROP_WITHIN_S = 15.0
#: How long the leak check waits, after each stretch of contexts, for what grew to be let go
#: (threads and descriptors let go as their users end; slack for a loaded machine).
SETTLE_S = 10.0


def _instances(kit: Kit) -> set[int]:
    return {c.instance_id for c in kit.client().status().contexts}


class LifecycleTests:
    def test_close_unregisters_and_further_submits_raise(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        kit.store(ctx, keys, blocks)
        assert ctx.instance_id in _instances(kit)
        ctx.close()
        assert ctx.instance_id not in _instances(kit), "close() must unregister the context"
        with pytest.raises(KvxferError, match=r"closed"):
            ctx.submit_store(keys, blocks)
        with pytest.raises(KvxferError, match=r"closed"):
            ctx.submit_retrieve(keys, blocks)
        ctx.close()  # idempotent
        assert kit.client().lookup(kit.model, 1, hashes=keys) == 1, "stored chunks outlive the context"

    def test_close_waits_for_submitted_transfers(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys = kit.keys(4)
        fut = ctx.submit_store(keys, kit.blocks(spec, 4))
        ctx.close()
        assert fut.done(), "close() must wait for the transfers submitted before it"
        assert fut.result().stored == [0, 1, 2, 3]
        assert kit.client().lookup(kit.model, 1, hashes=keys) == 4

    def test_client_close_closes_its_contexts(self, kit: Kit) -> None:
        spec = kit.spec()
        client = kit.client(new=True)
        ids = {kit.register(kit.kv(spec), spec, client=client).instance_id for _ in range(2)}
        assert ids <= _instances(kit)
        client.close()
        assert not ids & _instances(kit)

    def test_contexts_leave_nothing_behind(self, kit: Kit) -> None:
        """Contexts registered, used and closed one after another leave nothing behind: the
        open descriptors, threads and (with KV on the CPU) memory mappings of the client's
        process, and the open descriptors and the files and folders (in its private directory)
        of the server's, do not grow with them: counted after each of up to three stretches of 4
        more contexts, none grew in two of them. A transport that keeps a descriptor, a mapping, a
        file, a folder or a client thread per request or per context fails here. (The server's
        threads are not counted: its pools grow to their bounds as work comes.)"""
        if not sys.platform.startswith("linux"):
            pytest.skip("counts descriptors and threads through /proc")
        spec = kit.spec()
        layers = kit.kv(spec)
        status = kit.client().status()
        server_pid = status.pid if os.path.isdir(f"/proc/{status.pid}/fd") else None  # (in another PID namespace)
        private = Path(kit.client().arena_path).parent

        def counts() -> dict[str, int]:
            out = {"client descriptors": len(os.listdir("/proc/self/fd")),
                   "client threads": len(os.listdir("/proc/self/task")),
                   "entries in the server's directory": sum(len(dirs) + len(files)
                                                            for _, dirs, files in os.walk(private))}
            if kit.device == "cpu":  # (a device's driver maps memory of its own as it goes)
                with open("/proc/self/maps", "rb") as maps:
                    out["client memory mappings"] = sum(1 for _ in maps)
            if server_pid is not None:
                out["server descriptors"] = len(os.listdir(f"/proc/{server_pid}/fd"))
            return out

        def use_and_close() -> None:
            ctx = kit.register(layers, spec)
            for _ in range(4):
                keys, blocks = kit.keys(2), kit.blocks(spec, 2)
                assert kit.store(ctx, keys, blocks).stored == [0, 1]
                assert kit.retrieve(ctx, keys, kit.blocks(spec, 2)).loaded == [0, 1]
            ctx.close()

        def settled(since: dict[str, int]) -> dict[str, int]:
            deadline = time.monotonic() + SETTLE_S
            now = counts()
            while any(now[k] > since[k] for k in since) and time.monotonic() < deadline:
                time.sleep(0.1)
                now = counts()
            return now

        def growths(key: str) -> int:
            return sum(later[key] > earlier[key] for earlier, later in zip(seen, seen[1:]))

        use_and_close()  # what a first context makes once (pools, caches) stays
        seen = [counts()]
        for stretch in range(3):
            for _ in range(4):
                use_and_close()
            seen.append(settled(seen[-1]))
            # decided once two stretches grew, or once the stretches left cannot make two
            if any(growths(k) >= 2 for k in seen[0]) or all(growths(k) + 2 - stretch <= 1 for k in seen[0]):
                break
        # what grows by contexts grows stretch after stretch; the process's own growth (its
        # allocator's arenas, say, mapped as new threads first allocate) comes once and stops
        grown = {k: [c[k] for c in seen] for k in seen[0] if growths(k) >= 2}
        assert not grown, (f"stretches of 4 more contexts, each with 4 stores and 4 retrieves, registered and "
                           f"closed, left more behind in two of them (at the start, after each): {grown}")

    def test_dead_client_is_dropped(self, kit: Kit) -> None:
        """SIGKILL a process that registered: the server drops it within seconds, and serves on."""
        spec = kit.spec()
        cmd = [sys.executable, "-m", "kvxfer.testing._child", "--url", kit.url, "--transport", kit.name,
               "--device", kit.device, "--model", kit.model, "--layout", spec.kind.value, "--dtype", spec.dtype]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = _read_line(proc, TIMEOUT)
            assert line.startswith("registered "), f"child did not register: {line!r}\n{_stderr(proc)}"
            iid = int(line.split()[1])
            assert iid in _instances(kit)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            deadline = time.monotonic() + DROP_WITHIN_S
            while iid in _instances(kit):
                assert time.monotonic() < deadline, f"instance {iid} of a killed client still registered"
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        ctx = kit.register(kit.kv(spec), spec)   # the server serves on
        assert kit.store(ctx, kit.keys(1), kit.blocks(spec, 1)).stored == [0]

    def test_ranks_of_one_model_from_threads(self, kit: Kit) -> None:
        """world_size 2: ranks 0 and 1 register and transfer from two threads (two connections);
        a lookup counts a chunk only when every rank has it."""
        spec = kit.spec()
        keys = kit.keys(3)
        layers = [kit.kv(spec) for _ in range(2)]
        clients = [kit.client(new=True) for _ in range(2)]
        ctxs: list[TransferContext | None] = [None, None]
        errors: list[BaseException] = []
        barrier = threading.Barrier(2, timeout=TIMEOUT)

        def register(rank: int) -> None:
            try:
                barrier.wait()
                ctxs[rank] = kit.register(layers[rank], spec, world_size=2, rank=rank, client=clients[rank])
            except BaseException as exc:  # noqa: BLE001  (surfaced below, on the test's thread)
                errors.append(exc)

        _run_threads(register, 2)
        assert not errors, errors
        r0, r1 = ctxs
        assert r0 is not None and r1 is not None
        src = [kit.blocks(spec, 3) for _ in range(2)]
        assert kit.store(r0, keys, src[0]).stored == [0, 1, 2]
        assert kit.client().lookup(kit.model, 2, hashes=keys) == 0, "rank 1 has nothing yet"
        assert kit.store(r1, keys[:2], src[1][:2 * kit.blocks_per_chunk]).stored == [0, 1]
        assert kit.client().lookup(kit.model, 2, hashes=keys) == 2

        before = [as_bytes(t) for t in layers]
        dst = [kit.blocks(spec, 2, exclude=s) for s in src]
        results: list[RetrieveResult | None] = [None, None]

        def retrieve(rank: int) -> None:
            try:
                barrier.wait()
                results[rank] = kit.retrieve((r0, r1)[rank], keys[:2], dst[rank])
            except BaseException as exc:  # noqa: BLE001  (surfaced below, on the test's thread)
                errors.append(exc)

        _run_threads(retrieve, 2)
        assert not errors, errors
        for rank in range(2):
            res = results[rank]
            assert res is not None and res.loaded == [0, 1]
            assert_retrieved(kit, spec, layers[rank], before[rank], dst[rank],
                             kit.chunks_of(before[rank], spec, src[rank][:2 * kit.blocks_per_chunk]))

    def test_instances_of_different_models_at_once(self, kit: Kit) -> None:
        spec = kit.spec()
        n = 3
        layers = [kit.kv(spec) for _ in range(n)]
        ctxs = [kit.register(layers[i], spec, model=f"{kit.model}-{i}", client=kit.client(new=True))
                for i in range(n)]
        errors: list[BaseException] = []
        barrier = threading.Barrier(n, timeout=TIMEOUT)

        def work(i: int) -> None:
            try:
                barrier.wait()
                for _ in range(3):
                    keys, src = kit.keys(2), kit.blocks(spec, 2)
                    before = as_bytes(layers[i])
                    assert kit.store(ctxs[i], keys, src).stored == [0, 1]
                    dst = kit.blocks(spec, 2, exclude=src)
                    assert kit.retrieve(ctxs[i], keys, dst).loaded == [0, 1]
                    assert_retrieved(kit, spec, layers[i], before, dst, kit.chunks_of(before, spec, src))
            except BaseException as exc:  # noqa: BLE001  (surfaced below, on the test's thread)
                errors.append(exc)

        _run_threads(work, n)
        assert not errors, errors


def _run_threads(fn: Callable[[int], None], n: int) -> None:
    """Run ``fn(0) .. fn(n - 1)`` on ``n`` threads and wait (bounded) for all of them."""
    threads = [threading.Thread(target=fn, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
        assert not t.is_alive(), "a worker thread of the test did not finish"


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line the child prints within ``timeout`` (what it printed so far if none)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
            break
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf.decode(errors="replace").strip()


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None or proc.stderr is None:
        return ""
    return proc.stderr.read().decode(errors="replace")[-2000:]
