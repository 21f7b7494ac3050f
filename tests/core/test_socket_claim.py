"""The claim a server holds on its ipc:// socket path (kvxfer.mq.claim), with real server
processes: servers started at once, restarted, or after a crash; what kvxfer status says
meanwhile; lock files that cannot be trusted."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvxfer.cli import main
from kvxfer.mq.claim import socket_claimed, take
from kvxfer.testing.server import ServerProcess


def kvxfer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=timeout)


def _wait_for(what: str, ok, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.02)


def test_a_server_started_while_another_is_making_its_arena_at_one_socket_is_refused_at_once(tmp_path: Path) -> None:
    """Two servers started at once at one ipc:// socket: the first claims the socket before it
    makes its arena (here 1 GiB, seconds to pre-fault), so the second, started meanwhile with a
    small arena, is refused at once, instead of binding first and leaving the first to fail
    after its arena (or, binding last, taking the socket from a server that runs)."""
    first = ServerProcess(l1_size="1GiB", url=f"ipc://{tmp_path}/run/kvxfer.sock")
    failed: list[BaseException] = []

    def start() -> None:
        try:
            first.start()
        except BaseException as exc:  # noqa: BLE001  (asserted below)
            failed.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    try:
        _wait_for("arena announcement", lambda: "making the L1 arena" in first.log() or not starter.is_alive())
        second = kvxfer("serve", "--url", first.url, "--l1-size", "8MiB")
        starter.join(120)
        assert not failed, failed
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"another server is starting, listening or stopping at {first.url}" in second.stderr, second.stderr
    finally:
        starter.join(120)
        first.stop()


def test_status_while_a_server_is_starting_waits_and_says_so(tmp_path: Path, capsys) -> None:
    """A server claims its socket before it makes its arena (seconds for a large one) and makes
    the socket after: status waits its --timeout for it, then says a server is starting. The
    claim is taken here as a server takes it."""
    (tmp_path / "run").mkdir(mode=0o700)
    path = tmp_path / "run" / "kvxfer.sock"
    claim = take(f"ipc://{path}", path)
    try:
        assert main(["status", "--url", f"ipc://{path}", "--timeout", "0.5"]) == 2
        err = capsys.readouterr().err
        assert f"a kvxfer server is starting at ipc://{path} (it holds {path}.lock) but made no socket within 0.5 s" \
            in err, err
        assert "--timeout S" in err
        # the socket file of a server that died is there too: still a server starting, not a stale socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(path))
        assert main(["status", "--url", f"ipc://{path}", "--timeout", "0.5"]) == 2
        err = capsys.readouterr().err
        assert f"a kvxfer server is starting at ipc://{path} (it holds {path}.lock) and has not replaced the " \
               "socket file left there" in err, err
    finally:
        claim.release()
    os.unlink(path)
    assert main(["status", "--url", f"ipc://{path}", "--timeout", "3600"]) == 2  # released: none is starting
    assert "and none is starting" in capsys.readouterr().err


def test_status_right_after_launching_a_server_waits_for_it(tmp_path: Path) -> None:
    """``kvxfer serve ... & kvxfer status``: the status starts before the server has claimed
    its socket (its interpreter is still starting), and waits for it all the same."""
    url = f"ipc://{tmp_path}/run/kvxfer.sock"
    srv = ServerProcess(l1_size="64MiB", url=url)
    log = open(srv.log_path, "wb")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(srv.args, stdout=log, stderr=subprocess.STDOUT)
    try:
        st = kvxfer("status", "--url", url, "--timeout", "60")
        assert st.returncode == 0, st.stdout + st.stderr
        assert f"at {url}" in st.stdout
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_a_server_restarted_after_a_crash_is_waited_for_through_its_predecessors_socket(tmp_path: Path) -> None:
    """A supervisor restarts a server that was killed: the dead server's socket file is still
    there while the new one pre-faults its arena. Clients wait for the new server (it holds the
    claim) instead of giving up on the stale socket."""
    url = f"ipc://{tmp_path}/run/kvxfer.sock"
    with ServerProcess(l1_size="64MiB", url=url) as dead:
        dead.kill()
        assert Path(url[len("ipc://"):]).exists()  # left behind
        assert not socket_claimed(url)  # the kernel dropped the claim with the process
        successor = ServerProcess(l1_size="1GiB", url=url)
        successor._log = open(successor.log_path, "wb")  # noqa: SIM115  (closed by stop())
        successor.proc = subprocess.Popen(successor.args, stdout=successor._log, stderr=subprocess.STDOUT)
        try:
            _wait_for("claim", lambda: socket_claimed(url) or successor.proc.poll() is not None)
            st = kvxfer("status", "--url", url, "--timeout", "60")
            assert st.returncode == 0, st.stdout + st.stderr
            assert f"pid {successor.proc.pid}" in st.stdout
        finally:
            successor.stop()


def test_a_stopping_server_removes_only_the_socket_it_bound(tmp_path: Path) -> None:
    """Server A's socket directory is deleted while it runs (by hand, or a cleaner of stale
    files), and server B starts at the same url. A stops: B's socket stays, and clients reach B
    (A removed whatever was at its path, and left B running and unreachable)."""
    import shutil

    from kvxfer.client import CacheClient

    url = f"ipc://{tmp_path}/run/kvxfer.sock"
    with ServerProcess(l1_size="8MiB", url=url) as a:
        shutil.rmtree(tmp_path / "run")
        with ServerProcess(l1_size="8MiB", url=url) as b:
            assert a.stop() == 0
            assert Path(url[len("ipc://"):]).exists(), "the stopping server removed another's socket"
            with CacheClient(url, connect_timeout=10.0) as client:
                assert client.status().pid == b.proc.pid


def test_a_server_dropped_without_serving_lets_its_socket_go(tmp_path: Path) -> None:
    """A CacheServer made in a process and dropped without serve_forever (its claim collected
    with it): another server can be made at the same socket."""
    from kvxfer.server import CacheServer, ServerConfig

    url = f"ipc://{tmp_path}/run/kvxfer.sock"
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    server = CacheServer(ServerConfig(url=url, l1_size=8 << 20, shm_dir=str(shm), transports=("cpu_gather",)))
    assert socket_claimed(url)
    server.arena.close()
    del server
    gc.collect()
    assert not socket_claimed(url)


@pytest.mark.parametrize("plant", ["open to others", "hard link", "fifo"])
def test_a_lock_file_that_others_could_hold_is_refused_before_the_arena(tmp_path: Path, plant: str) -> None:
    """Another user able to open the lock file could hold a lock on it and keep every server
    out; a server makes it 0600 with one name, so anything else is refused, by name."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)  # a socket directory others may read (allowed)
    lock = run / "kvxfer.sock.lock"
    if plant == "open to others":
        lock.touch(mode=0o644)
        os.chmod(lock, 0o644)
        says = "is open to other users (mode 644)"
    elif plant == "hard link":
        lock.touch(mode=0o600)
        os.link(lock, tmp_path / "elsewhere")
        says = "has other names (hard links)"
    else:
        os.mkfifo(lock, 0o600)
        says = "is a FIFO"
    r = kvxfer("serve", "--url", f"ipc://{run}/kvxfer.sock", "--l1-size", "64TiB")  # no arena is made
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{lock}" in r.stderr and says in r.stderr, r.stderr


def test_socket_paths_a_bind_would_refuse_are_refused_before_the_arena(tmp_path: Path) -> None:
    """A path too long for a Unix socket, and the lock file of a server beside it: said before
    a 64 TiB arena would have been attempted, without advice to remove another server's file."""
    long = tmp_path / ("d" * 60) / ("s" * 60)
    r = kvxfer("serve", "--url", f"ipc://{long}", "--l1-size", "64TiB")
    assert r.returncode == 2 and "a Unix socket's path has at most 107 bytes" in r.stderr, r.stderr
    with ServerProcess(l1_size="8MiB") as srv:
        r = kvxfer("serve", "--url", srv.url + ".lock", "--l1-size", "64TiB")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "exists and is not a socket (the lock a kvxfer server holds for its socket beside it)" in r.stderr
        assert "remove" not in r.stderr
