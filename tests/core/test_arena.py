"""The arena's mappings (server and client side) stay mapped while a view of them lives: a slot
view that outlives ``close()`` (held by a traceback, a late thread) reads and writes the bytes
it had, instead of crashing the process. Each case runs in a child process, so that a crash is
a failing test, not a lost run."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from kvxfer_core_helpers import run_python

CASES = {
    "server": """
        arena = Arena.create(1 << 20, shm_dir=base)
        view = arena.view(4096, 64)
        view.fill_(7)
        arena.close()
        arena.close()  # twice: nothing more happens
        for late in (arena.view, arena.memoryview):
            try:
                late(0, 8)
            except ValueError as exc:
                assert "is closed" in str(exc), exc
            else:
                raise AssertionError("a closed arena handed out a view")
    """,
    "client": """
        arena = Arena.create(1 << 20, shm_dir=base)
        mapping = ArenaMapping(str(arena.path), arena.size)
        view = mapping.view(4096, 64)[8:].view(torch.int16)  # a view of a view, as the slot tables make
        view.fill_(0x0707)
        mapping.close()
        mapping.close()  # twice: nothing more happens
        try:
            mapping.view(0, 8)
        except ValueError as exc:
            assert "is closed" in str(exc), exc
        else:
            raise AssertionError("a closed mapping handed out a view")
        arena.close()
    """,
}


@pytest.mark.parametrize("side", sorted(CASES))
def test_a_view_that_outlives_close_keeps_its_bytes(side: str, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    code = "import torch\nfrom kvxfer.arena import Arena, ArenaMapping\nbase = " + repr(str(shm)) + "\n" + \
        textwrap.dedent(CASES[side]) + textwrap.dedent("""
        total = int(view.view(torch.uint8).sum())
        view.add_(1)  # still writable
        print(total, int(view.view(torch.uint8)[0]))
    """)
    done = run_python(code, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    n = 64 if side == "server" else 56
    assert done.stdout.split() == [str(7 * n), "8"]  # every byte 7; then the first one (low byte) 8


def test_the_mapping_goes_with_the_last_view(tmp_path: Path) -> None:
    """Closed with a view alive, the mapping stays; once the view goes it is unmapped, though the
    arena object still exists (it holds no reference to the mapping any more)."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    from kvxfer.arena import Arena, ArenaMapping

    def maps() -> int:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return sum(str(shm) in line for line in f)

    arena = Arena.create(1 << 20, shm_dir=shm)
    mapping = ArenaMapping(str(arena.path), arena.size)
    view, view2 = arena.view(0, 64), mapping.view(0, 64)
    assert maps() == 2
    mapping.close()
    arena.close()
    assert maps() == 2  # the views keep both
    del view, view2
    assert maps() == 0



def test_a_client_maps_only_the_arena_file_of_a_server_directory_of_its_user(tmp_path: Path) -> None:
    """The arena's path comes from the server's handshake reply. A server (over tcp://, anyone
    holding its key) that names another private file of the client's user, of the size it
    announces, is refused: the client would copy KV bytes over it (a key file, say), or copy its
    bytes into the engine's KV cache."""
    from kvxfer.arena import ArenaMapping
    from kvxfer.errors import ConfigError

    private = tmp_path / "ssh"
    private.mkdir(mode=0o700)
    secret = b"ssh-ed25519 AAAA... the user's key\n".ljust(4096, b"#")
    uid = os.getuid()
    named = [private / "authorized_keys", private / "arena", tmp_path / f"kvxfer-x{uid}-{'0' * 32}" / "arena",
             tmp_path / f"kvxfer-{uid}-{'0' * 31}" / "arena", tmp_path / f"kvxfer-{uid}-{'0' * 32}" / "server.lock"]
    for path in named:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_bytes(secret)
        path.chmod(0o600)
        with pytest.raises(ConfigError, match="not the arena file of a kvxfer server"):
            ArenaMapping(str(path), len(secret))
        assert path.read_bytes() == secret


def test_an_arena_made_under_a_relative_shm_dir_is_announced_whole(tmp_path: Path, monkeypatch) -> None:
    """A server made through the API with a relative ``shm_dir`` announced a relative arena path,
    which a client (that maps only an arena directory's ``arena`` file, by a whole path) refused."""
    from kvxfer.arena import Arena, ArenaMapping

    (tmp_path / "shm").mkdir(mode=0o700)
    monkeypatch.chdir(tmp_path)
    arena = Arena.create(1 << 20, "shm")
    try:
        assert arena.path.is_absolute() and arena.path.parent.parent == tmp_path / "shm"
        ArenaMapping(str(arena.path), arena.size).close()
    finally:
        arena.close()
