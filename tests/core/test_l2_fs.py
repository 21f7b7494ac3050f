"""The ``fs`` store backend: the store conformance kit, and what only a directory store does
(byte budget with LRU, atomic files, one server per directory, its URL)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from pathlib import Path

import pytest

from kvxfer.errors import ConfigError
from kvxfer.store import GetStatus, StoreOptions
from kvxfer.store.fs import FsStore, parse_fs_url
from kvxfer.testing import StoreConformance


class TestFsConformance(StoreConformance):
    store = "fs"


def _put(backend, key: bytes, data: bytes) -> bool:
    return backend.submit_put([(key, [memoryview(data)])]).result(10)[0]


def test_budget_evicts_least_recently_used_values(tmp_path: Path) -> None:
    b = FsStore().open(f"file://{tmp_path}/l2?max_size=12KiB", StoreOptions())
    try:
        for i in range(3):
            assert _put(b, b"k%d" % i, bytes([i]) * 4096)
        # reading k0 makes k1 the least recently used
        assert b.submit_get([(b"k0", [memoryview(bytearray(4096))])]).result(10) == [GetStatus.HIT]
        assert _put(b, b"k3", b"x" * 4096)
        assert b.submit_exists([b"k0", b"k1", b"k2", b"k3"]).result(10) == [4096, 0, 4096, 4096]
        assert not _put(b, b"big", b"y" * (13 << 10)), "a value above the whole budget is refused"
        assert b.stats()["evictions"] == "1"
    finally:
        b.close()


def test_values_are_files_written_atomically_and_privately(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        _put(b, b"key", b"v" * 100)
        files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
        assert len(files) == 1 and files[0].read_bytes() == b"v" * 100
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o600 and stat.S_IMODE(root.stat().st_mode) == 0o700
        # a write cut short by a crash leaves a temporary file: the next open removes it
        (files[0].parent / f"{files[0].name}.123.456.0.tmp").write_bytes(b"partial")
    finally:
        b.close()
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        assert not list(root.rglob("*.tmp"))
        assert b.submit_exists([b"key"]).result(10) == [100]
    finally:
        b.close()


def test_a_link_planted_in_place_of_the_directory_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    """The store deletes files in its directory (eviction, cut writes): a symbolic link in its
    place, say in a sticky directory others may write to, must never lead it elsewhere."""
    victim = tmp_path / "victim"
    (victim / "ab").mkdir(parents=True)
    (victim / "ab" / "draft.tmp").write_text("mine")
    (victim / "ab" / "notes").write_text("x" * 8192)
    victim.chmod(0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "l2").symlink_to(victim)
    with pytest.raises(ConfigError, match="fs store directory"):
        FsStore().open(f"file://{shared}/l2?max_size=4KiB", StoreOptions())
    assert (victim / "ab" / "draft.tmp").read_text() == "mine" and (victim / "ab" / "notes").exists()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755 and not (victim / ".kvxfer-fs.lock").exists()


def test_a_directory_of_other_files_is_refused_and_left_alone(tmp_path: Path) -> None:
    """The store makes its directory 0700 and deletes files in it: one that holds files and no
    store's lock file (a home directory given by mistake) is refused before anything changes."""
    home = tmp_path / "home"
    (home / "ab").mkdir(parents=True)
    (home / "ab" / "abstract.txt").write_text("x" * 8192)
    (home / "xy").mkdir()
    (home / "xy" / "notes.tmp").write_text("draft")
    home.chmod(0o755)
    with pytest.raises(ConfigError, match=f"the fs store directory {home} holds files \\(ab, xy\\) and no "
                                          "\\.kvxfer-fs\\.lock"):
        FsStore().open(f"file://{home}?max_size=4KiB", StoreOptions())
    assert stat.S_IMODE(home.stat().st_mode) == 0o755 and not (home / ".kvxfer-fs.lock").exists()
    assert (home / "ab" / "abstract.txt").exists() and (home / "xy" / "notes.tmp").exists()
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    FsStore().open(f"file://{empty}", StoreOptions()).close()  # an empty directory is taken
    (home / "xy" / "notes.tmp").unlink()
    (home / "xy").rmdir()  # subdirectories named like the store's, but a directory open to others
    with pytest.raises(ConfigError, match="holds files \\(ab\\) and no"):
        FsStore().open(f"file://{home}?max_size=4KiB", StoreOptions())


def test_a_stores_directory_that_lost_its_lock_file_is_taken_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Removing the lock file (by hand, or a restore that left it out) made every later start
    of the server fail: the directory was taken for one of other files. A 0700 directory that
    holds nothing but subdirectories named as the store names them is the store's: its lock file
    is made again and its values are found."""
    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        assert _put(b, b"k", b"v" * 4096)
        (root / ".kvxfer-fs.lock").unlink()  # under a live server: a second is still refused
        with pytest.raises(ConfigError, match="another kvxfer server uses the fs store"):
            FsStore().open(f"file://{root}", StoreOptions())
        assert b.submit_exists([b"k"]).result(10) == [4096]
    finally:
        b.close()
    (root / ".kvxfer-fs.lock").unlink()
    with caplog.at_level(logging.WARNING, logger="kvxfer.store.fs"):
        b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        assert b.submit_exists([b"k"]).result(10) == [4096]
        assert (root / ".kvxfer-fs.lock").is_file()
        assert any("lock file .kvxfer-fs.lock was missing" in r.getMessage() for r in caplog.records)
    finally:
        b.close()
    (root / ".kvxfer-fs.lock").unlink()
    (root / "notes.txt").write_text("mine")  # anything else in it: refused as before
    with pytest.raises(ConfigError, match="no \\.kvxfer-fs\\.lock"):
        FsStore().open(f"file://{root}", StoreOptions())


def test_files_the_store_did_not_name_are_never_deleted(tmp_path: Path) -> None:
    """Eviction and the clean-up of cut writes touch only names the store makes."""
    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        for i in range(4):
            assert _put(b, b"k%d" % i, bytes([i]) * 4096)
    finally:
        b.close()
    sub = next(p for p in root.iterdir() if p.is_dir())
    foreign = [sub / "abstract.txt", sub / "notes.tmp", sub / (sub.name + "0" * 30 + ".tmp")]
    for f in foreign:
        f.write_text("mine")
    b = FsStore().open(f"file://{root}?max_size=4KiB", StoreOptions())  # evicts all but one value
    try:
        assert sorted(b.submit_exists([b"k%d" % i for i in range(4)]).result(10)).count(0) == 3
    finally:
        b.close()
    assert all(f.read_text() == "mine" for f in foreign)


def test_what_is_not_a_regular_file_in_place_of_a_value_is_a_wrong_size_not_a_hang(tmp_path: Path) -> None:
    """A FIFO put in place of a value file (by a process of the server's user, after the store
    indexed it) held the read thread in open() for ever: the promotion never ended and every
    retrieve of the chunk timed out. A FIFO, a link, a socket and a directory now read as values
    of the wrong size, at once, and the store forgets them and removes all but the directory
    (which it did not make)."""
    import contextlib

    from kvxfer.store.fs import _name

    root = tmp_path / "l2"
    outside = tmp_path / "outside"
    outside.write_bytes(b"v" * 4096)
    b = FsStore().open(f"file://{root}", StoreOptions())
    fifo = root / _name(b"fifo")[:2] / _name(b"fifo")
    try:
        keys = [b"fifo", b"link", b"socket", b"dir"]
        for key in keys:
            assert _put(b, key, b"v" * 4096)
        paths = {k: root / _name(k)[:2] / _name(k) for k in keys}
        for p in paths.values():
            p.unlink()
        os.mkfifo(fifo, 0o600)
        paths[b"link"].symlink_to(outside)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(paths[b"socket"]))  # opening it fails (ENXIO): once a store error every time
        paths[b"dir"].mkdir()
        bufs = [bytearray(4096) for _ in keys]
        got = b.submit_get([(k, [memoryview(buf)]) for k, buf in zip(keys, bufs)]).result(10)
        assert got == [GetStatus.WRONG_SIZE] * 4
        assert not any(os.path.lexists(paths[k]) for k in keys[:3]) and paths[b"dir"].is_dir()
        assert b.submit_delete(keys).result(10) == 0
        assert b.submit_exists(keys).result(10) == [0] * 4
        sock.close()
    finally:
        with contextlib.suppress(OSError):  # a reader stuck in open() (the old code) is let go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        b.close()


def test_a_value_another_process_holds_a_lease_on_is_a_miss_of_that_key_only(tmp_path: Path) -> None:
    """A write lease another process of the server's user holds on a value file (a file server,
    a backup tool) makes the store's non-blocking open fail with EWOULDBLOCK: that failed the
    whole get (its other keys missed too), and repeated, it took the tier down. Now that key is
    a miss this time, its value is kept, and the other keys of the get are read."""
    import signal
    import subprocess
    import sys

    from kvxfer.store.fs import _name

    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    holder = None
    try:
        for key in (b"leased", b"free"):
            assert _put(b, key, key * 512)
        path = root / _name(b"leased")[:2] / _name(b"leased")
        holder = subprocess.Popen([sys.executable, "-c", f"""if True:
            import fcntl, os, signal, sys, time
            signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease-break notice: the lease is kept
            fd = os.open({str(path)!r}, os.O_RDONLY)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            print("leased", flush=True)
            time.sleep(60)
            """], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
        bufs = [bytearray(len(b"leased") * 512), bytearray(len(b"free") * 512)]
        got = b.submit_get([(k, [memoryview(buf)]) for k, buf in zip((b"leased", b"free"), bufs)]).result(10)
        assert got == [GetStatus.MISS, GetStatus.HIT] and bytes(bufs[1]) == b"free" * 512
        assert b.submit_exists([b"leased"]).result(10) == [len(b"leased") * 512]  # still indexed, not deleted
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        holder = None
        assert b.submit_get([(b"leased", [memoryview(bufs[0])])]).result(10) == [GetStatus.HIT]
        assert bytes(bufs[0]) == b"leased" * 512
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(10)
        b.close()


def test_a_directory_planted_in_place_of_a_value_refuses_that_key_only(tmp_path: Path) -> None:
    """A directory where a value's file goes (made by a process of the server's user) makes the
    rename of that value fail: the put of that key is refused (False), not a store failure (a
    raise, which the tier counts: three in a row took L2 down for every client); the old value's
    entry stays indexed while its file stays, and other keys are written as usual."""
    from kvxfer.store.fs import _name

    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        assert _put(b, b"kept", b"k" * 4096)
        planted = root / _name(b"planted")[:2] / _name(b"planted")
        planted.parent.mkdir(mode=0o700, exist_ok=True)
        planted.mkdir()
        (planted / "inside").write_text("not the store's")  # not even an empty directory
        for _ in range(4):
            assert b.submit_put([(b"planted", [memoryview(b"v" * 4096)])]).result(10) == [False]
        assert _put(b, b"other", b"o" * 4096)
        assert b.submit_exists([b"kept", b"planted", b"other"]).result(10) == [4096, 0, 4096]
        assert b.used == 2 * 4096 and (planted / "inside").read_text() == "not the store's"
        assert not [p for p in planted.parent.iterdir() if p.name.endswith(".tmp")], "no temporary file left"
    finally:
        b.close()


def test_a_link_planted_in_place_of_a_subdirectory_is_never_written_read_or_deleted_through(tmp_path: Path) -> None:
    """Values live in subdirectories named by their first two characters. A link put in place
    of one (by a process of the server's user) once had puts write into its target and evictions
    delete there: the store now opens its subdirectories without following links, so such a put
    is refused, a get misses, and the target is left as it was; a subdirectory removed behind
    the store's back is made again."""
    import shutil

    from kvxfer.store.fs import _name

    root = tmp_path / "l2"
    outside = tmp_path / "outside"
    outside.mkdir()
    key = b"planted"
    name = _name(key)
    (outside / name).write_bytes(b"o" * 4096)  # what a read through the link would find
    b = FsStore().open(f"file://{root}?max_size=8KiB", StoreOptions())
    try:
        (root / name[:2]).symlink_to(outside)
        assert not _put(b, key, b"v" * 4096)
        assert b.submit_get([(key, [memoryview(bytearray(4096))])]).result(10) == [GetStatus.MISS]
        others = [k for k in (b"k%d" % i for i in range(64)) if _name(k)[:2] != name[:2]][:3]
        for k in others:  # the budget holds two: evictions go on around the link
            assert _put(b, k, b"x" * 4096)
        assert b.submit_exists(others).result(10).count(0) == 1
        gone = root / _name(others[-1])[:2]
        shutil.rmtree(gone)  # removed behind the store's back after it was opened
        assert _put(b, others[-1], b"y" * 4096) and (gone / _name(others[-1])).read_bytes() == b"y" * 4096
    finally:
        b.close()
    assert sorted(os.listdir(outside)) == [name] and (outside / name).read_bytes() == b"o" * 4096
    b = FsStore().open(f"file://{root}?max_size=8KiB", StoreOptions())  # a restart skips the link too
    try:
        assert b.submit_exists([key]).result(10) == [0]
    finally:
        b.close()
    assert sorted(os.listdir(outside)) == [name]


def test_the_store_holds_no_descriptor_but_its_directorys_and_its_locks(tmp_path: Path) -> None:
    """Each operation opens the subdirectory it needs and closes it: a store that kept one per
    subdirectory (256) took the descriptors a server near its open-file limit keeps for itself."""
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    b = FsStore().open(f"file://{tmp_path}/l2", StoreOptions())
    try:
        for i in range(600):  # values in (nearly) every one of the 256 subdirectories
            assert _put(b, b"k%d" % i, b"v" * 64)
        assert b.submit_get([(b"k1", [memoryview(bytearray(64))])]).result(10) == [GetStatus.HIT]
        assert b.submit_delete([b"k2"]).result(10) == 1
        assert len({p.name for p in (tmp_path / "l2").iterdir() if p.is_dir()}) > 200
        assert open_fds() - before == 2, "the directory and the lock"
    finally:
        b.close()
    assert open_fds() == before


def test_a_directory_replaced_behind_the_store_fails_its_ping(tmp_path: Path) -> None:
    """The store works through the descriptor of the directory it opened: one removed and made
    anew at its path (a temporary-file cleaner) is not its own, and its health check says so
    rather than passing while every write fails."""
    import shutil

    from kvxfer.errors import StoreUnavailable

    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        b.ping()
        shutil.rmtree(root)
        root.mkdir(mode=0o700)
        with pytest.raises(StoreUnavailable, match="removed or replaced"):
            b.ping()
    finally:
        b.close()


def test_one_server_per_directory(tmp_path: Path) -> None:
    b = FsStore().open(f"file://{tmp_path}/l2", StoreOptions())
    try:
        with pytest.raises(ConfigError, match="another kvxfer server uses the fs store"):
            FsStore().open(f"file://{tmp_path}/l2", StoreOptions())
    finally:
        b.close()
    FsStore().open(f"file://{tmp_path}/l2", StoreOptions()).close()  # free again once closed


@pytest.mark.parametrize("url, match", [
    ("file://relative/dir", "not an absolute local path"),
    ("s3://bucket/x", "unsupported URL"),
    ("file:///tmp/x?budget=1", "unknown option"),
    ("file:///tmp/x?max_size=lots", "not a size"),
])
def test_bad_urls_say_what_a_good_one_is(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_fs_url(url)


@pytest.mark.parametrize("url", ["file:///tmp/x?password=SECRET", "file://u:SECRET@host/tmp/x",
                                 "s3://u:SECRET@bucket/x", "file:///tmp/x?fsync=2&token=SECRET"])
def test_errors_never_quote_a_secret(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_fs_url(url)
    assert "SECRET" not in str(info.value) and "***" in str(info.value), str(info.value)


def test_the_default_budget_counts_the_stores_own_files_so_a_restart_keeps_them(tmp_path: Path) -> None:
    """Without max_size the budget is 90% of the free space plus what the store already holds:
    a restart sees less free space (its files take it) and must not evict them for that."""
    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        vfs = os.statvfs(root)
        first = b.max_size
        assert first == int(vfs.f_bavail * vfs.f_frsize * 0.9) or abs(first - vfs.f_bavail * vfs.f_frsize * 0.9) < (1 << 20)
        for i in range(4):
            assert _put(b, b"k%d" % i, bytes([i]) * (1 << 20))
    finally:
        b.close()
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        assert b.used == 4 << 20 and b.evictions == 0
        assert b.submit_exists([b"k%d" % i for i in range(4)]).result(10) == [1 << 20] * 4
        assert abs(b.max_size - first) < (16 << 20)  # the same budget, give or take other writers to the disk
    finally:
        b.close()


def test_what_a_scan_at_open_meets_never_keeps_the_store_down_or_its_budget_inflated(tmp_path: Path) -> None:
    """A directory named like a write cut short made the scan raise (IsADirectoryError) at every
    retry, keeping L2 down; a sparse file named like a value counted its size into the default
    budget (past the disk's), so the disk filled under a budget it never reached. Now: the
    directory is left alone, and the budget is never more than the disk holds."""
    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    first = b.max_size
    b.close()
    (root / "ab").mkdir(mode=0o700)
    (root / "ab" / ("ab" + "0" * 30 + ".1.2.3.tmp")).mkdir()
    vfs = os.statvfs(root)
    with open(root / "ab" / ("ab" + "1" * 30), "wb") as f:
        f.truncate(vfs.f_blocks * vfs.f_frsize * 4)
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        assert first <= b.max_size <= int(vfs.f_blocks * vfs.f_frsize * 0.9), (b.max_size, first)
        assert b.evictions == 1 and b.used == 0  # the sparse file, past the budget, went first
        assert (root / "ab" / ("ab" + "0" * 30 + ".1.2.3.tmp")).is_dir()
        assert _put(b, b"k", b"v" * 4096)
    finally:
        b.close()


def test_a_budget_smaller_than_the_files_found_evicts_the_oldest_at_open(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        for i in range(4):
            assert _put(b, b"k%d" % i, bytes([i]) * 4096)
            time.sleep(0.01)  # distinct modification times: the scan orders by them
    finally:
        b.close()
    b = FsStore().open(f"file://{root}?max_size=8KiB", StoreOptions())
    try:
        assert b.submit_exists([b"k%d" % i for i in range(4)]).result(10) == [0, 0, 4096, 4096]
        assert b.evictions == 2
    finally:
        b.close()


def test_url_options(tmp_path: Path) -> None:
    root, size, fsync = parse_fs_url(f"file://{tmp_path}/a?max_size=2GiB&fsync=1")
    assert (root, size, fsync) == (tmp_path / "a", 2 << 30, True)
    root, size, fsync = parse_fs_url(str(tmp_path / "b"))
    assert root == tmp_path / "b" and size is None and not fsync  # the default: set at open
    assert os.path.isabs(root)
    assert parse_fs_url(f"file://{tmp_path}/c?fsync=on")[2] and not parse_fs_url(f"file://{tmp_path}/c?fsync=off")[2]
    with pytest.raises(ConfigError, match="fsync must be 0 or 1"):
        parse_fs_url(f"file://{tmp_path}/c?fsync=always")


def test_fsync_syncs_each_value_and_then_its_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fsync=1`` a put syncs its file, then the folder that holds it (the rename that
    makes the value visible is the folder's to keep), and a fan-out folder it made is synced
    into the store's folder first: without these a power loss may undo the put. A file system
    that cannot sync a folder (EINVAL) fails no put. A power loss cannot be made here, so the
    calls are recorded: the real ``os.fsync`` runs."""
    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        st = os.fstat(fd)
        synced.append("file" if not stat.S_ISDIR(st.st_mode) else
                      "store" if os.path.samestat(st, os.stat(tmp_path / "s1")) else "folder")
        real(fd)

    def no_folders(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    for fsync, want in ((1, [["store", "file", "folder"], ["file", "folder"]]), (0, [[], []])):
        b = FsStore().open(f"file://{tmp_path}/s{fsync}?fsync={fsync}", StoreOptions())
        try:
            for key, expected in zip((b"k", b"k"), want):  # the first put makes its fan-out folder
                monkeypatch.setattr(os, "fsync", record)
                assert _put(b, key, b"v" * 4096)
                monkeypatch.setattr(os, "fsync", real)
                assert synced == expected, (fsync, synced)
                synced.clear()
            monkeypatch.setattr(os, "fsync", no_folders)
            assert _put(b, b"other", b"w" * 4096) and _put(b, b"k", b"u" * 4096)
            monkeypatch.setattr(os, "fsync", real)
            assert b.submit_exists([b"k", b"other"]).result(10) == [4096, 4096]
        finally:
            monkeypatch.setattr(os, "fsync", real)
            b.close()


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_lock_file_planted_as_a_link_or_directory_is_refused_with_what_to_do(tmp_path: Path, kind: str) -> None:
    """The lock file is opened without following links: one planted in its place was an
    OSError with no advice (and L2 started down, retrying for ever)."""
    root = tmp_path / "l2"
    root.mkdir(mode=0o700)
    lock = root / ".kvxfer-fs.lock"
    if kind == "symlink":
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        lock.mkdir()
    with pytest.raises(ConfigError, match="lock file .* is not a regular file of yours .*remove it"):
        FsStore().open(f"file://{root}", StoreOptions())
    assert not (tmp_path / "elsewhere").exists()


def test_a_store_whose_parent_is_missing_is_refused_and_a_budget_past_the_disk_is_warned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``file:///mnt/nvme/kvxfer`` where no disk is mounted at /mnt/nvme made /mnt/nvme on the
    root file system and went on to fill it: kvxfer makes only the store's own directory. A
    ``max_size`` past what its file system has is accepted, with a warning (the disk may grow)."""
    with pytest.raises(ConfigError, match=r"does not exist\. Create it, or mount the disk"):
        FsStore().open(f"file://{tmp_path}/not-mounted/kvxfer", StoreOptions())
    assert not (tmp_path / "not-mounted").exists()
    with caplog.at_level(logging.WARNING, logger="kvxfer.store.fs"):
        FsStore().open(f"file://{tmp_path}/l2?max_size=1000000TiB", StoreOptions()).close()
    assert "max_size 1000000.0 TiB is more than its file system has free" in caplog.text


def test_a_threaded_backend_withdraws_only_what_its_own_threads_would_run(tmp_path: Path) -> None:
    """``ThreadedBackend.withdraw`` cancels a future its own pools queued (the kit's withdraw
    test covers those), and no other: a subclass whose ``submit_get`` returns a future of its own
    (an asyncio task's, another pool's) runs that work on whatever cancelling the future says.
    Withdrawn, the promotion's arena slots were freed and reused while the work went on and
    wrote into them: the chunks stored there loaded wrong bytes."""
    from concurrent.futures import Future

    backend = FsStore().open(f"file://{tmp_path}/s", StoreOptions(timeout_s=5.0))
    try:
        theirs: Future[list[GetStatus]] = Future()
        assert backend.withdraw(theirs) is False and not theirs.cancelled()
        mine = backend.submit_exists([b"kvxfer:x"])
        mine.result(5)
        assert backend.withdraw(mine) is False, "an ended operation is not withdrawn"
    finally:
        backend.close()


def test_what_a_get_learns_never_undoes_a_put_that_landed_meanwhile(tmp_path: Path) -> None:
    """A get that met no value (a link here) forgot the name under the lock, then removed the
    file by name outside it: a put of the key in between (acknowledged) was deleted. A get that
    found a value of another size recorded that size, also over a put's newer one. Both now act
    under the lock, as puts replace, and only on what they met. The interleavings are forced by
    calling each step as the get would, after the put has landed."""
    from kvxfer.store.fs import _name

    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        key = b"k" * 32
        path = root / _name(key)[:2] / _name(key)
        assert _put(b, key, b"v" * 100)
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
        assert _put(b, key, b"w" * 100)  # the put lands after the get's open met the link
        b._not_a_value(_name(key))
        assert path.is_file() and not path.is_symlink() and b.submit_exists([key]).result(10) == [100]
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
        b._not_a_value(_name(key))  # still no value: forgotten and removed
        assert not os.path.lexists(path) and b.submit_exists([key]).result(10) == [0]

        assert _put(b, key, b"v" * 100)
        with open(path, "r+b") as f:  # shortened behind the store's back, as a get then sees it
            f.truncate(60)
        seen = os.stat(path)
        assert _put(b, key, b"x" * 200)  # a put replaces it before the get records the size
        b._resized(_name(key), seen)
        assert b.submit_exists([key]).result(10) == [200]
        seen = os.stat(path)
        with open(path, "r+b") as f:
            f.truncate(60)
        b._resized(_name(key), os.stat(path))
        assert b.submit_exists([key]).result(10) == [60] and seen.st_ino == os.stat(path).st_ino
    finally:
        b.close()


def test_a_get_that_found_no_file_keeps_a_value_a_put_wrote_meanwhile(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A get whose open found no file forgot the name at once, without looking again under the
    lock: a put of the key that landed in between (acknowledged, its file on disk) was then
    neither found by lookups nor counted in the budget until a restart. The get's miss is forced
    here (its open says there is no file, as it would have a moment before the put)."""
    from kvxfer.store import fs as fsmod

    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        key = b"k" * 32
        name = fsmod._name(key)
        assert _put(b, key, b"v" * 100)
        real = os.open

        def missing_once(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if path == name:
                monkeypatch.setattr(os, "open", real)
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", missing_once)
        assert b.submit_get([(key, [memoryview(bytearray(100))])]).result(10) == [GetStatus.MISS]
        assert b.submit_exists([key]).result(10) == [100] and b.used == 100
        (root / name[:2] / name).unlink()  # now really gone: forgotten
        assert b.submit_get([(key, [memoryview(bytearray(100))])]).result(10) == [GetStatus.MISS]
        assert b.submit_exists([key]).result(10) == [0] and b.used == 0
    finally:
        b.close()


def test_a_value_that_cannot_be_read_is_a_miss_of_that_key_only(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails (EIO: a bad sector, a soft NFS mount's timeout) failed the whole get,
    and with it every chunk of the batch and a count toward the circuit breaker, each time the
    chunk was promoted. Now that value alone is a miss, this time (it is kept: the error may
    pass); the others of the batch are read."""
    from kvxfer.store import fs as fsmod

    root = tmp_path / "l2"
    b = FsStore().open(f"file://{root}", StoreOptions())
    try:
        bad, good = b"b" * 32, b"g" * 32
        assert _put(b, bad, b"v" * 100) and _put(b, good, b"w" * 100)
        real = fsmod._readv_all
        calls = []

        def eio_first(fd: int, parts):  # type: ignore[no-untyped-def]
            calls.append(fd)
            if len(calls) == 1:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, parts)

        monkeypatch.setattr(fsmod, "_readv_all", eio_first)
        bufs = [bytearray(100), bytearray(100)]
        assert b.submit_get([(bad, [memoryview(bufs[0])]), (good, [memoryview(bufs[1])])]).result(10) == \
            [GetStatus.MISS, GetStatus.HIT]
        assert bufs[1] == b"w" * 100
        assert b.submit_exists([bad, good]).result(10) == [100, 100] and b.used == 200
        assert b.submit_get([(bad, [memoryview(bufs[0])])]).result(10) == [GetStatus.HIT]  # it passed
        assert bufs[0] == b"v" * 100
    finally:
        b.close()
