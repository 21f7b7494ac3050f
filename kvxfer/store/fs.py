"""``fs``: an L2 tier in a local directory (an NVMe drive), built on the store contract.

``kvxfer serve --l2 fs --l2-url file:///mnt/nvme/kvxfer?max_size=200GiB``

* one file per value, under a two-level fan-out (``ab/abcdef...``), named by a hash of the key;
  written to a temporary file in the same directory and renamed over the old one (atomic: a
  reader sees a whole old value or a whole new one, never a torn one), ``fsync``'d (the file, then
  its folder) when the URL says ``fsync=1``;
* a byte budget (``max_size``, default: 90% of what the store may take at open: the file
  system's free space plus its own files, so that a restart does not shrink it) kept by
  evicting the least recently used files; reads count as use; the temporary files being
  written count too (a put evicts before it writes, and waits while other puts' temporary
  files leave no room), so the store's files never hold more bytes than the budget (the file
  system's blocks round each file up: small values take more of the disk);
* the directory is private (0700, files 0600; checked as :mod:`kvxfer.private_dirs` checks
  kvxfer's own: never through a symbolic link) and held by one server at a time (an exclusive
  ``flock``): give each server its own directory. Every file operation goes through descriptors
  of the directory and its subdirectories, opened without following links: a link put in place
  of a subdirectory is never written, read or deleted through. A restarted server finds every value again
  (the index is rebuilt from the files, oldest first).

Reads go straight into the caller's buffers (``readv``), writes straight from them (``writev``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import re
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final
from urllib.parse import parse_qs, unquote, urlsplit

from kvxfer.errors import ConfigError, StoreUnavailable
from kvxfer.mq.throttled_log import ThrottledLog
from kvxfer.private_dirs import ensure_private_dir
from kvxfer.store.base import (
    STORE_API_VERSION,
    GetItem,
    GetStatus,
    Probe,
    PutItem,
    Store,
    StoreCapabilities,
    StoreOptions,
    ThreadedBackend,
    redact_url,
)
from kvxfer.units import format_bytes, parse_size
from kvxfer.urls import has_control_character

__all__ = ["FsStore", "FsBackend"]

log = logging.getLogger(__name__)

#: The mark of a directory an fs store made (the lock that keeps one server per directory is taken
#: on the directory itself, which a hand cannot delete from under a live server).
_LOCK_NAME: Final = ".kvxfer-fs.lock"
#: How the store opens its directory and subdirectories: never through a link.
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_SUFFIX: Final = ".tmp"
_OPTIONS: Final = frozenset({"max_size", "fsync"})
#: What a write into a full disk (or past a quota) fails with.
_DISK_FULL: Final = (errno.ENOSPC, errno.EDQUOT)
#: The default budget's share of the file system's free space plus the store's own files.
DEFAULT_SHARE: Final = 0.9


#: Why opening a value's file may fail when something other than a readable regular file is
#: under its name (a link, a socket, a device, a file made unreadable): a value of the wrong
#: size (the tier deletes it), not a failure of the store.
_NOT_A_VALUE: Final = frozenset({errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EACCES, errno.EPERM})


def _name(key: bytes) -> str:
    return hashlib.blake2b(key, digest_size=16).hexdigest()


#: What this store names in its directory: value files under a subdirectory named by their first
#: two characters, and writes in progress; the scan touches nothing else.
_SUBDIR: Final = re.compile(r"[0-9a-f]{2}")
_FILE: Final = re.compile(r"[0-9a-f]{32}")
_TMP_FILE: Final = re.compile(r"[0-9a-f]{32}\.[0-9]+\.[0-9]+\.[0-9]+" + re.escape(_TMP_SUFFIX))


def _refuse_unless_own(root: Path) -> None:
    """ConfigError unless ``root`` is empty, holds this store's lock file (a directory an fs
    store made), or is a store's directory that lost its lock file (mode 0700, and nothing in it
    but subdirectories named as the store names them: the lock file is made again, with a
    warning): the store makes the directory 0700 and deletes files in it."""
    entries = os.listdir(root)
    if entries and _LOCK_NAME not in entries and _mode(root) == stat.S_IFDIR | 0o700 \
            and all(_SUBDIR.fullmatch(e) and stat.S_ISDIR(_mode(root / e)) for e in entries):
        log.warning("fs store %s: its lock file %s was missing (removed, or not restored with the values); the "
                    "directory holds only the store's own subdirectories, so it is taken as the store's and the "
                    "lock file made again", root, _LOCK_NAME)
        return
    if entries and _LOCK_NAME not in entries:
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(f"the fs store directory {root} holds files ({shown}) and no {_LOCK_NAME}: it is not "
                          "a store's directory, and the store would change its mode and delete files in it; give "
                          "--l2-url a new or empty directory of its own")


def _mode(path: Path) -> int:
    """``st_mode`` of ``path`` itself (a link is not followed); 0 where there is nothing."""
    try:
        return os.stat(path, follow_symlinks=False).st_mode
    except OSError:
        return 0


def _readv_all(fd: int, parts: Sequence[memoryview]) -> int:
    """Fill ``parts`` from ``fd``; returns the bytes read (less only at end of file)."""
    total = 0
    bufs = [p.cast("B") if p.format != "B" else p for p in parts if len(p)]
    while bufs:
        n = os.readv(fd, bufs)
        if n == 0:
            break
        total += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]
    return total


def _writev_all(fd: int, parts: Sequence[memoryview]) -> None:
    bufs = [p.cast("B") if p.format != "B" else p for p in parts if len(p)]
    while bufs:
        n = os.writev(fd, bufs)
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]


def _fsync_folder(fd: int) -> None:
    """``fsync`` a folder's descriptor (its entries: a rename, a new folder). A file system that
    cannot sync a folder (EINVAL, ENOTSUP) keeps its entries as it keeps them: not an error."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EROFS):
            raise


class FsBackend(ThreadedBackend):
    """An open ``fs`` store: the directory, its lock and an LRU index of its files."""

    def __init__(self, root: Path, max_size: int | None, fsync: bool, options: StoreOptions) -> None:
        """``max_size`` None: 90% of the file system's free space plus the files found."""
        super().__init__("fs", options)
        self.root = root
        self.max_size = max_size or 0
        self.fsync = fsync
        self._lock = threading.Lock()
        #: a put whose temporary file would not fit waits here for other puts' to be renamed
        self._room = threading.Condition(self._lock)
        self._throttled = ThrottledLog(log)  # lines a failing disk would repeat for every value
        #: file name -> size, least recently used first
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        #: bytes of the temporary files being written: inside the budget too, never evicted
        self._writing = 0
        self.evictions = 0
        self._tmp_ids = itertools.count()
        # checked on the path itself (a symbolic link in its place, or in a parent others may
        # write to, is refused: this store deletes files in it), then made 0700 through a
        # descriptor of that very directory
        if not os.path.lexists(root) and not root.parent.is_dir():
            raise ConfigError(f"the fs store's directory {root} cannot be made: {root.parent} does not exist. Create "
                              "it, or mount the disk meant for the store there, first: kvxfer makes only the store's "
                              "own directory, so that a path meant for a disk that is not there is refused rather "
                              "than made on the file system below")
        ensure_private_dir(root, "fs store directory", "choose another --l2-url: a directory of yours")
        _refuse_unless_own(root)  # before anything is changed in it
        self._root_fd = os.open(root, _DIR_FLAGS)
        try:
            os.fchmod(self._root_fd, 0o700)
            self._lock_fd = os.open(_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                    dir_fd=self._root_fd)
        except OSError as exc:  # a link or a directory planted as the lock file: refused, not followed
            os.close(self._root_fd)
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM):
                raise ConfigError(f"the fs store's lock file {root / _LOCK_NAME} is not a regular file of yours "
                                  f"({exc.strerror}): remove it, or choose another --l2-url") from None
            if exc.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
                raise ConfigError(f"the fs store's directory {root} cannot be written ({exc.strerror}): choose "
                                  "another --l2-url, on a file system this server may write to") from None
            raise
        except BaseException:
            os.close(self._root_fd)
            raise
        try:  # on the directory itself: a lock file can be deleted under a live server, its directory cannot
            fcntl.flock(self._root_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.close_connections()
            raise ConfigError(f"another kvxfer server uses the fs store {root}; give each server its own "
                              "directory") from None
        try:
            self._scan(max_size)
        except BaseException:
            self.close_connections()
            raise

    def _scan(self, max_size: int | None) -> None:
        """Index the store's files, oldest first; set the default budget (``max_size`` None)
        from the free space and the files found; evict down to the budget."""
        found = []
        with os.scandir(self._root_fd) as entries:
            subs = sorted(e.name for e in entries if _SUBDIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
        for sub in subs:
            try:
                with self._subdir(sub) as fd:
                    if fd is None:
                        continue  # gone, or a link put in its place meanwhile
                    with os.scandir(fd) as files:
                        for f in files:
                            if _TMP_FILE.fullmatch(f.name) and f.name.startswith(sub):  # a write cut short by a crash
                                with contextlib.suppress(OSError):  # (a directory in its place is left alone)
                                    os.unlink(f.name, dir_fd=fd)
                                continue
                            if not _FILE.fullmatch(f.name) or not f.name.startswith(sub):
                                continue  # not this store's: never evicted
                            with contextlib.suppress(FileNotFoundError):
                                st = f.stat(follow_symlinks=False)
                                if stat.S_ISREG(st.st_mode):  # a link, a FIFO, a directory under a value's name
                                    found.append((st.st_mtime_ns, f.name, st.st_size))
            except OSError as exc:  # its files could be neither counted nor evicted, nor its keys written
                raise ConfigError(f"the fs store cannot read its subdirectory {self.root / sub} "
                                  f"({exc.strerror or exc}): make it the server user's again (mode 0700), or remove "
                                  "it") from None
        for _, name, size in sorted(found):
            self._lru[name] = size
            self.used += size
        vfs = os.fstatvfs(self._root_fd)
        # the files found are the store's to keep, but never more than the disk holds (a sparse
        # file's size is no room; blocks are not counted, as some file systems report none)
        room = min(vfs.f_bavail * vfs.f_frsize + self.used, vfs.f_blocks * vfs.f_frsize)
        if max_size is None:
            self.max_size = max(1, int(room * DEFAULT_SHARE))
        elif max_size > room:
            log.warning("fs store %s: max_size %s is more than its file system has free plus the store's files "
                        "(%s): once that is full, writes fail and take L2 down until files are removed; lower "
                        "max_size in --l2-url", self.root, format_bytes(max_size), format_bytes(room))
        self._make_room(0)

    def _open_subdir(self, sub: str, create: bool = False) -> int | None:
        """A new descriptor of subdirectory ``sub``, opened without following a link (made, 0700,
        with ``create``); None where there is none, or something else is in its place. Each
        operation opens its own and closes it (:meth:`_subdir`): the store holds no descriptor
        but its directory's and its lock's."""
        for attempt in range(2 if create else 1):
            if attempt:  # not there yet (made once; a put finds it there after)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(sub, 0o700, dir_fd=self._root_fd)
                if self.fsync:  # the new folder's entry in the store's (made here, or by a put beside
                    _fsync_folder(self._root_fd)  # this one that may not have synced it yet)
            try:
                return os.open(sub, _DIR_FLAGS, dir_fd=self._root_fd)
            except FileNotFoundError:
                continue
            except NotADirectoryError:
                return None
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                return None  # a link in its place: never followed
        return None

    def _subdir(self, sub: str, create: bool = False) -> contextlib.AbstractContextManager[int | None]:
        """:meth:`_open_subdir`, closed at the end of the block."""
        return self._closing(self._open_subdir(sub, create))

    @staticmethod
    @contextlib.contextmanager
    def _closing(fd: int | None) -> Iterator[int | None]:
        """``fd`` (None passes), closed at the end of the block."""
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _unlink(self, name: str) -> bool:
        """Delete the value file ``name`` (not a directory in its place); whether one was deleted."""
        with self._subdir(name[:2]) as fd:
            if fd is None:
                return False
            try:
                os.unlink(name, dir_fd=fd)
            except (FileNotFoundError, IsADirectoryError):  # a directory: not the store's to remove
                return False
            return True

    def _forget(self, name: str) -> int | None:
        """Take value ``name`` out of the index (lock held); its size, or None if not there."""
        size = self._lru.pop(name, None)
        if size is not None:
            self.used -= size
        return size

    def _gone(self, name: str) -> None:
        """A get found no file ``name``: forget it, unless a put wrote one there meanwhile (under
        the lock, as puts write: forgetting a put's file would leave it on disk, uncounted), or
        what is there cannot be told (left as it is)."""
        with self._lock:
            try:
                with self._subdir(name[:2]) as sub:
                    if sub is not None:
                        os.stat(name, dir_fd=sub, follow_symlinks=False)
                        return  # a put's, since
            except FileNotFoundError:
                pass
            except OSError:
                return
            self._forget(name)

    def _not_a_value(self, name: str) -> None:
        """A get met no value the store wrote under ``name`` (a link, a socket, a FIFO, a device,
        a file it cannot open). Under the lock, as a put replaces files under it: if the name still
        holds no value, forget it and remove it (not a directory), so that no lookup counts it
        again; a value a put wrote there meanwhile stays."""
        with self._lock, self._subdir(name[:2]) as sub:
            if sub is None:
                return
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub)
            except FileNotFoundError:
                fd = None
            except OSError as exc:
                if exc.errno not in _NOT_A_VALUE:
                    return
                fd = None
            if fd is not None:
                try:
                    if stat.S_ISREG(os.fstat(fd).st_mode):
                        return  # a value now: a put's
                finally:
                    os.close(fd)
            self._forget(name)
            with contextlib.suppress(OSError):  # a directory, or gone: nothing to remove
                os.unlink(name, dir_fd=sub)

    def _resized(self, name: str, seen: os.stat_result) -> None:
        """A get found value ``name`` (``seen``: its fstat) of another size than it asked for (a
        value of another layout written over it, a file shortened behind the store's back): the
        index takes its size, so that lookups count it as what it is, unless a put replaced it
        since (under the lock, as puts replace)."""
        with self._lock, self._subdir(name[:2]) as sub:
            if sub is None or name not in self._lru:
                return
            try:
                now = os.stat(name, dir_fd=sub, follow_symlinks=False)
            except OSError:
                return
            if (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
                return
            self.used += now.st_size - self._lru[name]
            self._lru[name] = now.st_size
            self._make_room(0)

    def _make_room(self, size: int) -> None:
        """Evict least recently used files until ``size`` more bytes fit beside the values and
        the temporary files being written (lock held or init)."""
        self._evict(self.used + self._writing + size - self.max_size)

    def _evict(self, size: int) -> int:
        """Evict least recently used files until at least ``size`` bytes are freed or none is
        left; the bytes freed (lock held or init)."""
        freed = 0
        while self._lru and freed < size:
            name, old = self._lru.popitem(last=False)
            self.used -= old
            self.evictions += 1
            freed += old
            self._unlink(name)
        return freed

    def _disk_full(self, exc: OSError, size: int) -> None:
        """A put of ``size`` bytes met a full disk although the store's files are within its
        budget: others' files took the room (or the budget was set past the disk). Reads go on:
        that value is not written, and the least recently used values make room for the next."""
        with self._lock:
            freed = self._evict(size)
        self._throttled.warning(
            "full", f"fs store {self.root}: the disk is full ({exc.strerror}) although the store's files are within "
                    f"max_size {format_bytes(self.max_size)}: a value was not written, and {format_bytes(freed)} of "
                    "the least recently used evicted for the next ones; give the store a file system (or a quota) "
                    "of its own, or lower max_size in --l2-url")

    def _reserve(self, size: int) -> None:
        """Count the ``size`` bytes of a temporary file about to be written inside the budget:
        evict for them, or wait while other puts' temporary files (never evicted) leave no room."""
        with self._room:
            while self._writing and self._writing + size > self.max_size:
                self._room.wait()
            self._make_room(size)
            self._writing += size

    def _unreserve(self, size: int) -> None:
        """``size`` bytes of a temporary file are no longer being written (lock held)."""
        self._writing -= size
        self._room.notify_all()

    # ------------------------------------------------------------------ blocking operations

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        with self._lock:
            return [self._lru.get(_name(k), 0) for k in keys]

    def get(self, items: Sequence[GetItem]) -> list[GetStatus]:
        out = []
        for key, parts in items:
            name = _name(key)
            want = sum(len(p) for p in parts)
            try:
                with self._subdir(name[:2]) as sub:
                    if sub is None:
                        raise FileNotFoundError(name)
                    # not blocking: a FIFO put under the name behind the store's back would hold
                    # this thread in open() for ever; not following a link out of the directory
                    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub)
            except FileNotFoundError:
                self._gone(name)  # removed behind our back
                out.append(GetStatus.MISS)
                continue
            except BlockingIOError:  # another process holds a lease on the file: a miss, this time only
                out.append(GetStatus.MISS)
                continue
            except OSError as exc:
                if exc.errno not in _NOT_A_VALUE:
                    raise
                self._not_a_value(name)  # a link, a socket, a device, a file made unreadable
                out.append(GetStatus.WRONG_SIZE)
                continue
            try:
                st = os.fstat(fd)
                size = st.st_size
                if not stat.S_ISREG(st.st_mode):  # a FIFO, a device...: not a value
                    self._not_a_value(name)
                    out.append(GetStatus.WRONG_SIZE)
                    continue
                if size != want:  # replaced since the lookup (another layout's value): its size now
                    self._resized(name, st)
                    out.append(GetStatus.WRONG_SIZE)
                    continue
                try:
                    got = _readv_all(fd, parts)
                except OSError as exc:  # EIO (a bad sector, a soft NFS mount's timeout): this value, this time
                    self._throttled.warning("unreadable", f"fs store {self.root}: value {name} cannot be read "
                                                          f"({exc.strerror or exc}): a miss this time")
                    out.append(GetStatus.MISS)
                    continue
                out.append(GetStatus.HIT if got == want else GetStatus.WRONG_SIZE)
            finally:
                os.close(fd)
            with self._lock:
                if name in self._lru:
                    self._lru.move_to_end(name)
        return out

    def put(self, items: Sequence[PutItem]) -> list[bool]:
        out = []
        for key, parts in items:
            name = _name(key)
            size = sum(len(p) for p in parts)
            if size > self.max_size:
                out.append(False)
                continue
            tmp = f"{name}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_ids)}{_TMP_SUFFIX}"
            try:
                sub_fd = self._open_subdir(name[:2], create=True)
            except OSError as exc:  # a subdirectory not made yet takes a block of a full disk too
                if exc.errno not in _DISK_FULL:
                    raise
                self._disk_full(exc, size)
                out.append(False)
                continue
            with self._closing(sub_fd) as sub:
                if sub is None:  # a link or a file where its subdirectory goes: not written through
                    out.append(False)
                    continue
                self._reserve(size)
                reserved = size
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=sub)
                    try:
                        _writev_all(fd, parts)
                        if self.fsync:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
                    with self._lock:
                        self._unreserve(size)  # counted as the value from here
                        reserved = 0
                        old = self._forget(name)  # not evicted to make its own room
                        self._make_room(size)
                        try:
                            os.replace(tmp, name, src_dir_fd=sub, dst_dir_fd=sub)
                        except OSError:
                            if old is not None:  # the old value is still there: indexed again
                                self._lru[name] = old
                                self.used += old
                            raise
                        self._lru[name] = size
                        self.used += size
                    if self.fsync:  # the rename too: else a power loss may undo it
                        _fsync_folder(sub)
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=sub)
                    if exc.errno in _DISK_FULL:
                        self._disk_full(exc, size)
                        out.append(False)
                        continue
                    if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                        out.append(False)  # something not a value's file in its place: this key only is refused
                        continue
                    raise
                finally:
                    if reserved:
                        with self._lock:
                            self._unreserve(reserved)
            out.append(True)
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            name = _name(key)
            with self._lock:  # unlinked under the lock: a put of the key cannot land in between
                if self._forget(name) is None:
                    continue
                n += self._unlink(name)
        return n

    def ping(self) -> None:
        """StoreUnavailable once the directory the store opened is gone or another is at its path
        (the store works through its descriptor: a directory made anew there is not its own)."""
        try:
            opened, now = os.fstat(self._root_fd), os.stat(self.root, follow_symlinks=False)
            same = opened.st_nlink > 0 and (opened.st_dev, opened.st_ino) == (now.st_dev, now.st_ino)
        except OSError:
            same = False
        if not same:
            raise StoreUnavailable(f"fs store directory {self.root} is gone (removed or replaced since the server "
                                   "opened it): restart the server to use the directory there now")

    def stats(self) -> dict[str, str]:
        with self._lock:
            return {"path": str(self.root), "values": str(len(self._lru)), "used": format_bytes(self.used),
                    "max_size": format_bytes(self.max_size), "evictions": str(self.evictions)}

    def close_connections(self) -> None:
        for fd in (self._lock_fd, self._root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class FsStore(Store):
    """The ``fs`` store backend (entry point ``kvxfer.stores: fs``)."""

    name = "fs"
    api_version = STORE_API_VERSION
    capabilities = StoreCapabilities(shared=False, persistent=True, max_value_bytes=1 << 40)
    url_schemes = ("file",)

    def probe(self) -> Probe:
        return Probe(True, "local directory store (one per server)")

    def open(self, url: str, options: StoreOptions) -> FsBackend:
        root, max_size, fsync = parse_fs_url(url)
        return FsBackend(root, max_size, fsync, options)

    @contextlib.contextmanager
    def local_instance(self, directory: Path) -> Iterator[str]:
        root = Path(directory) / "kvxfer-fs-l2"
        try:
            yield f"file://{root}"
        finally:
            shutil.rmtree(root, ignore_errors=True)


def parse_fs_url(url: str) -> tuple[Path, int | None, bool]:
    """``file:///abs/dir?max_size=SIZE&fsync=0|1`` (or a plain absolute path) -> (dir, bytes, fsync);
    bytes None without ``max_size`` (:class:`FsBackend` then takes :data:`DEFAULT_SHARE` of the
    free space and its files)."""
    hint = "expected file:///ABSOLUTE/DIR[?max_size=200GiB&fsync=1]"
    shown = repr(redact_url(url))  # what an error may quote of it
    s = urlsplit(url)
    if s.scheme not in ("file", ""):
        raise ConfigError(f"fs store: unsupported URL {shown}; {hint}")
    path = unquote(s.path)
    if s.netloc not in ("", "localhost") or not path.startswith("/"):
        raise ConfigError(f"fs store: {shown} is not an absolute local path; {hint}")
    if has_control_character(path):
        raise ConfigError(f"fs store: the path of {shown} holds a control character (a NUL?); {hint}")
    query = parse_qs(s.query, keep_blank_values=True)
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        raise ConfigError(f"fs store: unknown option(s) {', '.join(unknown)} in {shown}; {hint}")
    root = Path(path)
    fsync_text = query.get("fsync", ["0"])[-1].lower()
    if fsync_text not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ConfigError(f"fs store: fsync must be 0 or 1 in {shown}, got {fsync_text!r}; {hint}")
    fsync = fsync_text in ("1", "true", "yes", "on")
    max_size = None
    if "max_size" in query:
        max_size = parse_size(query["max_size"][-1])
        if max_size <= 0:
            raise ConfigError(f"fs store: max_size must be positive in {shown}")
    return root, max_size, fsync
