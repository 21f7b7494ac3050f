"""The liveness lock: a client's process holds it while it lives; the server tests it."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvxfer import CacheClient, liveness
from kvxfer.protocol import messages as m


def test_tokens_are_exactly_32_lowercase_hex_digits() -> None:
    token = liveness.new_token()
    assert liveness.valid_token(token) and token != liveness.new_token()
    for bad in ["", "0" * 31, "0" * 33, "A" * 32, "../" + "0" * 29, "0" * 31 + "\n", "g" * 32]:
        assert not liveness.valid_token(bad), bad
        assert not liveness.holder_alive("/tmp/x/arena", bad)
    with pytest.raises(ValueError, match="not a client token"):
        liveness.lock_path("/tmp/x/arena", "../../etc/passwd")


def _arena_dir(tmp_path: Path) -> Path:
    """A directory named and made as a server's arena directory."""
    d = tmp_path / f"kvxfer-{os.getuid()}-{'0' * 32}"
    d.mkdir(mode=0o700)
    return d


def test_a_held_lock_reads_alive_until_released(tmp_path: Path) -> None:
    directory = _arena_dir(tmp_path)
    arena = directory / "arena"
    token = liveness.new_token()
    assert not liveness.holder_alive(arena, token)  # never held
    lock = liveness.ProcessLock.hold(arena, token)
    assert lock is not None and lock.path == directory / f"client-{token}.lock"
    assert stat.S_IMODE(lock.path.stat().st_mode) == 0o600
    assert liveness.holder_alive(arena, token)  # flock conflicts between open files, even in one process
    assert liveness.holder_alive(arena, token)  # testing does not take it away
    lock.release()
    lock.release()
    assert not lock.path.exists() and not liveness.holder_alive(arena, token)


def test_no_lock_where_the_directory_cannot_be_reached_or_is_not_private(tmp_path: Path) -> None:
    assert liveness.ProcessLock.hold(tmp_path / f"kvxfer-{os.getuid()}-{'0' * 32}" / "arena",
                                     liveness.new_token()) is None
    directory = _arena_dir(tmp_path)
    directory.chmod(0o755)
    assert liveness.ProcessLock.hold(directory / "arena", liveness.new_token()) is None
    assert list(directory.iterdir()) == []


def test_no_lock_but_in_an_arena_directory_of_this_user(tmp_path: Path) -> None:
    """The arena path comes from the server's reply: a lock file is made only beside the arena
    file of a kvxfer server's directory of this user, never in another private directory the
    server names (one holding the user's keys, say)."""
    private = tmp_path / "ssh"
    private.mkdir(mode=0o700)
    misnamed = _arena_dir(tmp_path).rename(tmp_path / f"kvxfer-{os.getuid()}-{'0' * 31}")
    for arena in (private / "authorized_keys", private / "arena", misnamed / "arena",
                  _arena_dir(tmp_path) / "server.lock"):
        assert liveness.ProcessLock.hold(arena, liveness.new_token()) is None, arena
    assert not [p for p in tmp_path.rglob("client-*")]


def test_something_else_at_the_lock_path_is_not_a_live_client(tmp_path: Path) -> None:
    token = liveness.new_token()
    os.mkfifo(tmp_path / f"client-{token}.lock")  # opening it for reading must not block the server
    assert not liveness.holder_alive(tmp_path / "arena", token)


def test_the_lock_of_a_killed_process_is_free_and_its_file_removed(tmp_path: Path) -> None:
    directory = _arena_dir(tmp_path)
    token = liveness.new_token()
    arena = directory / "arena"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from kvxfer import liveness
        lock = liveness.ProcessLock.hold({str(arena)!r}, {token!r})
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        holder.send_signal(signal.SIGSTOP)  # frozen is alive
        assert liveness.holder_alive(arena, token)
        holder.kill()
        holder.wait(10)
        assert not liveness.holder_alive(arena, token)  # SIGKILL: no unlink ran, the kernel freed the lock
        assert not (directory / f"client-{token}.lock").exists()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_a_client_holds_its_lock_next_to_the_arena_while_it_is_open(client: CacheClient) -> None:
    lock = liveness.lock_path(client.arena_path, client._token)
    assert lock.exists() and liveness.holder_alive(client.arena_path, client._token)
    other = CacheClient(client.url)
    other_lock = liveness.lock_path(other.arena_path, other._token)
    assert other_lock.exists() and other_lock != lock
    other.close()
    assert not other_lock.exists()


def test_the_token_is_issued_by_the_server_and_a_claimed_one_is_ignored(client: CacheClient) -> None:
    """A client cannot choose the lock by which the server judges it: a handshake naming another
    client's token (an older client's ``client_token`` field) gets a token of its own, and a
    session secret."""
    import msgspec

    from kvxfer.protocol import codec
    from kvxfer.testing.wire import RawConnection

    conn = RawConnection(client.url)
    try:
        conn.send([codec.pack_id(1), b"handshake", codec.encode(
            {"protocol_version": m.PROTOCOL_VERSION, "client_name": "t", "pid": 1, "client_token": client._token})])
        frames = conn.recv(15.0)
        assert frames is not None, "no reply to the handshake"
        rid, status, payload = frames
        assert status == codec.OK
        reply = msgspec.msgpack.decode(payload, type=m.HandshakeReply)
        assert liveness.valid_token(reply.client_token) and reply.client_token != client._token
        assert len(reply.session_secret) == 16 and reply.session_secret != client._secret
    finally:
        conn.close()
    assert client.ping() > 0
