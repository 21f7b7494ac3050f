"""Private directories, checked on the path itself: never through a symbolic link of another user.

kvxfer keeps what only its user may touch (the ``ipc://`` socket, the arena, liveness locks, a
transport's files) in directories of that user that no one else can enter or change. Another
local user must not be able to pre-create such a directory (a squat), plant a symbolic link in
its place, or swap it later. So every such directory is

* looked at with ``lstat``/``O_NOFOLLOW``: a symbolic link in its place is refused, never followed;
* owned by the effective user and not writable by anyone else (modes it creates: 0700);
* inside a trusted parent chain: every directory above it is owned by root or this user and not
  writable by others, unless it is sticky (``/tmp``, ``/dev/shm``: others cannot rename or remove
  what is ours there), and every symbolic link on the way is root's or this user's.

Errors are :class:`kvxfer.errors.ConfigError` naming the path, what is wrong with it, and how to
choose another.
"""

from __future__ import annotations

import collections
import os
import stat
from pathlib import Path

from kvxfer.errors import ConfigError

__all__ = ["ensure_private_dir", "make_missing_dirs", "check_private_dir", "check_trusted_parents", "open_private_dir"]


def _refuse(what: str, path: Path, problem: str, hint: str) -> ConfigError:
    return ConfigError(f"{what} {path} {problem}; {hint}" if hint else f"{what} {path} {problem}")


def check_trusted_parents(path: Path, what: str, hint: str = "") -> None:
    """Every directory above ``path`` is owned by root or us, and not writable by others unless
    sticky: nobody else can move ``path`` away or put something in its place. The path is
    walked as the kernel walks it, one name at a time with ``lstat`` (``..`` from where the walk
    is): a symbolic link on the way must be root's or ours too (in a sticky ``/tmp`` anyone may
    plant one, and swap where it leads between our check and our use), and the names it leads
    to are walked the same way."""
    me = os.geteuid()
    parent = Path(path).parent
    todo = collections.deque(parent.parts[1:] if parent.is_absolute() else (*Path(os.getcwd()).parts[1:],
                                                                            *parent.parts))
    at = Path("/")
    _check_dir(at, os.lstat(at), path, what, hint, me)
    links = 0
    while todo:
        name = todo.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            at = at.parent  # (a directory this walk checked on its way down)
            continue
        a = at / name
        try:
            st = os.lstat(a)
        except OSError as exc:
            raise _refuse(what, path, f"cannot be checked: {a}: {exc.strerror}", hint) from None
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, me):
                raise _refuse(what, path, f"is reached through {a}, a symbolic link of uid {st.st_uid} (its owner "
                                          "could make it lead elsewhere)", hint)
            links += 1
            if links > _MAX_LINKS:
                raise _refuse(what, path, f"is reached through more than {_MAX_LINKS} symbolic links", hint)
            target = Path(os.readlink(a))
            if target.is_absolute():
                at = Path("/")
            todo.extendleft(reversed(target.parts[1:] if target.is_absolute() else target.parts))
            continue
        _check_dir(a, st, path, what, hint, me)
        at = a


#: Most symbolic links followed in one check (the kernel's own limit is 40).
_MAX_LINKS = 40


def _check_dir(a: Path, st: os.stat_result, path: Path, what: str, hint: str, me: int) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, path, f"cannot be checked: {a} is not a directory", hint)
    if st.st_uid not in (0, me):
        raise _refuse(what, path, f"is inside {a}, which belongs to uid {st.st_uid} (others could replace "
                                  "what kvxfer keeps there)", hint)
    if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(what, path, f"is inside {a}, which others may write to (mode "
                                  f"{stat.S_IMODE(st.st_mode):o}, not sticky)", hint)


def check_private_dir(path: Path, what: str, hint: str = "", *, private: bool = True) -> os.stat_result:
    """``lstat`` checks of an existing directory: not a link, ours, not writable by others (and,
    with ``private``, not open to others at all). Returns its stat."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise _refuse(what, path, "does not exist", hint) from None
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(what, path, f"is a symbolic link (to {os.readlink(path)}), which kvxfer never follows "
                                  "here: someone may have planted it", hint)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, path, "is not a directory", hint)
    if st.st_uid != me:
        raise _refuse(what, path, f"belongs to uid {st.st_uid}, not to you (uid {me}): another user created "
                                  "it first", hint)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise _refuse(what, path, f"is writable by others (mode {mode:o}); use a private directory (mode 0700)",
                      hint)
    if private and mode & 0o077:
        raise _refuse(what, path, f"is open to others (mode {mode:o}); use a private directory (mode 0700)", hint)
    return st


def ensure_private_dir(path: Path, what: str, hint: str = "", *, private: bool = False) -> Path:
    """Create ``path`` (0700, and missing parents 0700) unless it exists, then check it and its
    parents (:func:`check_private_dir`, :func:`check_trusted_parents`). An existing directory
    must not be writable by others; with ``private``, not open to them at all."""
    path = Path(path)
    make_missing_dirs(path, what, hint)
    check_private_dir(path, what, hint, private=private)
    return path


def make_missing_dirs(path: Path, what: str, hint: str = "") -> None:
    """Create ``path`` and its missing parents (0700), each only after the directories above it
    passed :func:`check_trusted_parents` (nothing is made where it is not ours to make: through
    another user's link, say); then check the parents of ``path`` itself. ``path`` itself, new
    or not, is the caller's to check."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    if missing:
        check_trusted_parents(missing[-1], what, hint)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:  # a read-only file system, a directory not ours to write in
            raise _refuse(what, path, f"cannot be made ({d}: {exc.strerror})", hint) from None
    check_trusted_parents(path, what, hint)


def open_private_dir(path: Path, what: str, hint: str = "") -> int:
    """A descriptor of the private directory ``path`` (``O_NOFOLLOW``), checked again through
    the descriptor itself, for operations relative to it (``dir_fd=``)."""
    check_private_dir(path, what, hint)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _refuse(what, path, f"cannot be opened: {exc.strerror}", hint) from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise _refuse(what, path, "changed while it was being opened", hint)
    return fd
