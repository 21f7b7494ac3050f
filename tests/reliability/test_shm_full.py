"""The shared-memory filesystem filling up after the server started.

The server's arena is reserved in full when the server starts (``posix_fallocate``) and mapped
pre-faulted, so a tmpfs that fills up afterwards (another program's files) can no longer take
pages from under it: no SIGBUS, stores and retrieves stay bit-exact, new clients still connect
(their liveness lock is an empty file). What does need space there fails with a typed error and
works again once there is room: here the example transport's spool files (their failure is the
transport's, named by the core's error boundary). File systems that are read-only, or exactly
the size of the fs store's budget, are met by the fs L2 store as well.

Needs a tmpfs of its own: the test mounts one (as root); elsewhere it skips.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from relkit import Writer, key

from kvxfer import CacheClient
from kvxfer.errors import KvxferError, RemoteError
from kvxfer.store import GetStatus, StoreOptions
from kvxfer.store.fs import FsStore
from kvxfer.testing.server import ServerProcess


def _tmpfs(mnt: Path, options: str):
    """A tmpfs mounted at ``mnt`` with ``options`` for the test's length (skips where mounting fails)."""
    mnt.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    yield from _tmpfs(tmp_path / "shm", "size=24m,mode=0700")


def fill(directory: Path) -> Path:
    """Write a file in ``directory`` until its filesystem has no block left."""
    path = directory / "filler"
    block = b"\xa5" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError:
                block = block[: len(block) // 2]
                if not block:
                    break
    vfs = os.statvfs(directory)
    assert vfs.f_bavail == 0, vfs
    return path


def test_a_full_shared_memory_filesystem_after_start(small_tmpfs):
    from kvxfer_file_transport import FileContext

    with ServerProcess(l1_size="16MiB", chunk_size=64, transports="cpu_gather,file_debug",
                       extra_args=["--shm-dir", str(small_tmpfs)]) as server:
        client = CacheClient(server.url, timeout=20)
        w = Writer(client, model="full")
        before = [key("full", j) for j in range(8)]
        assert w.store(before).stored == list(range(8))
        debug = client.register(w.shape.make(), model_name="full", block_size=w.shape.block_size,
                                transport="file_debug")
        assert isinstance(debug, FileContext)

        filler = fill(small_tmpfs)
        # the arena's pages were reserved at start: stores and retrieves go on, bit-exact
        after = [key("full", j) for j in range(8, 16)]
        assert w.store(after).stored == list(range(8))
        for batch in (before, after):
            res, bad = w.retrieve(batch)
            assert res.loaded == list(range(8)) and bad == []
        with CacheClient(server.url) as newcomer:  # its liveness lock takes no block
            assert newcomer.lookup("full", hashes=before) == 8
        # the example transport's spool files need room: its failure is reported (the core's boundary
        # names the transport and the step), not a crash
        blocks = list(range(w.bpc))
        with pytest.raises(RemoteError) as info:
            debug.submit_retrieve(before[:1], blocks).result(30)
        assert "file_debug" in str(info.value) and "No space left" in str(info.value), info.value
        with pytest.raises(KvxferError, match="No space left"):  # nor can its client side write one
            debug.submit_store([key("full", 99)], blocks).result(30)

        filler.unlink()
        res = debug.submit_retrieve(before[:1], blocks).result(30)
        assert res.loaded == [0]
        assert debug.submit_store([key("full", 99)], blocks).result(30).stored == [0]
        debug.close()
        client.close()
        log = server.log()
        assert "handler of" not in log, log[-3000:]  # no handler failed: only the plugin, as logged
        assert log.count("Traceback") == log.count("failed in retrieve: OSError: [Errno 28]"), log[-3000:]


@pytest.fixture
def read_only_tmpfs(tmp_path: Path):
    yield from _tmpfs(tmp_path / "ro", "ro,size=64m,mode=0700")


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--l1-size", "16MiB", *args],
                          capture_output=True, text=True, timeout=60)


def test_a_read_only_file_system_is_refused_with_what_to_do(read_only_tmpfs, tmp_path):
    """An arena directory (--shm-dir) or an fs store directory (--l2-url file://...) on a file
    system the server cannot write to: the server exits at once (status 2) saying where and what
    to pass instead. The arena's printed a traceback; the fs store's left L2 down, retried with
    backoff for the server's life."""
    r = _serve("--shm-dir", str(read_only_tmpfs), "--url", f"ipc://{tmp_path}/a.sock")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot make the L1 arena in" in r.stderr and "--shm-dir" in r.stderr and "Traceback" not in r.stderr
    for url in (f"file://{read_only_tmpfs}/kv", f"file://{read_only_tmpfs}"):
        r = _serve("--l2", "fs", "--l2-url", url, "--url", f"ipc://{tmp_path}/b.sock")
        assert r.returncode == 2, (url, r.stderr[-2000:])
        assert "Read-only file system" in r.stderr and "--l2-url" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture
def small_disk(tmp_path: Path):
    yield from _tmpfs(tmp_path / "disk", "size=64k,mode=0700")


def _put(backend, key: bytes, data: bytes) -> bool:
    return backend.submit_put([(key, [memoryview(data)])]).result(10)[0]


def test_temporary_files_of_puts_count_in_the_budget(small_disk: Path) -> None:
    """A budget of the whole disk is never passed, not even for the moment a put's temporary file
    is written beside the values (it was: the least recently used value was evicted only at the
    rename, so the fifth value of a full disk met ENOSPC, and a full disk stops the tier). Six
    writers at once, of which four fill the budget, wait for each other's room rather than fill
    the disk."""
    b = FsStore().open(f"file://{small_disk}/l2?max_size=64KiB", StoreOptions(write_workers=6))
    try:
        for i in range(8):
            assert _put(b, b"k%d" % i, bytes([i]) * (16 << 10))
        futs = [b.submit_put([(b"c%d" % i, [memoryview(bytes([i]) * (16 << 10))])]) for i in range(16)]
        assert [f.result(10) for f in futs] == [[True]] * 16
        # The four that stay are the last four renamed, which need not be the last four
        # submitted: writers waiting for room are woken in any order.
        sizes = b.submit_exists([b"c%d" % i for i in range(16)]).result(10)
        assert sorted(sizes) == [0] * 12 + [16 << 10] * 4, sizes
        assert int(b.stats()["evictions"]) == 20 and b.used == 64 << 10
    finally:
        b.close()


def test_a_disk_others_fill_fails_a_write_and_keeps_the_reads(small_disk: Path) -> None:
    """Another user's files take the room the budget counted on: a put met ENOSPC and raised
    StoreUnavailable, which took the whole tier down, reads of the values on disk included. Now
    that value alone is not written, the store's least recently used values make room for the
    next, and the others are read as before."""
    b = FsStore().open(f"file://{small_disk}/l2?max_size=48KiB", StoreOptions())
    try:
        assert _put(b, b"k0", b"\x00" * (16 << 10)) and _put(b, b"k1", b"\x01" * (16 << 10))
        fd = os.open(small_disk / "others", os.O_WRONLY | os.O_CREAT, 0o600)  # another user's file, to the last byte
        try:
            while os.write(fd, b"\xff" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        assert not _put(b, b"k2", b"\x02" * (16 << 10)), "a value was written into a full disk"
        assert b.submit_exists([b"k0", b"k1", b"k2"]).result(10) == [0, 16 << 10, 0]  # k0 made room
        buf = bytearray(16 << 10)
        assert b.submit_get([(b"k1", [memoryview(buf)])]).result(10) == [GetStatus.HIT] and buf == b"\x01" * (16 << 10)
        assert _put(b, b"k3", b"\x03" * (16 << 10))
    finally:
        b.close()


def test_a_full_disk_fails_a_put_that_needs_a_new_subdirectory_alone(tmp_path: Path) -> None:
    """A value whose two-hex-digit subdirectory is not made yet needs an inode (a block, on ext4)
    for it: on a full disk that mkdir failed outside the put's handling of a full disk, and took
    L2 down. Here a tmpfs of 16 inodes, all taken by another user's files."""
    import hashlib

    for disk in _tmpfs(tmp_path / "disk", "size=1m,nr_inodes=16,mode=0700"):
        b = FsStore().open(f"file://{disk}/l2?max_size=256KiB", StoreOptions())
        try:
            assert _put(b, b"k0", b"\x00" * 4096)
            taken = hashlib.blake2b(b"k0", digest_size=16).hexdigest()[:2]
            new = next(k for k in (b"n%d" % i for i in range(1000))
                       if hashlib.blake2b(k, digest_size=16).hexdigest()[:2] != taken)
            n = 0
            while True:  # another user's files take every inode left
                try:
                    (disk / f"others{n}").touch()
                except OSError:
                    break
                n += 1
            assert not _put(b, new, b"\x01" * 4096), "a value was written into a full disk"
            assert b.submit_exists([b"k0"]).result(10) == [0]  # evicted to make room for the next
        finally:
            b.close()
