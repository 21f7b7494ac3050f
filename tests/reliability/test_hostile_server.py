"""A hostile (or broken) server, as the command-line tools meet it: a fake ``ipc://`` server that
speaks the wire (framing by :mod:`kvxfer.mq.stream`, no kvxfer server code) and answers the
handshake and ``status`` with what a real one never sends. Nothing it says reaches the terminal
as a control sequence, no reply makes a client spin or grow without bound."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvxfer import CacheClient
from kvxfer.errors import KvxferError
from kvxfer.mq.stream import FrameReader, pack
from kvxfer.protocol import messages as m

#: Control sequences a terminal acts on: set the window title, clear the screen, turn text red.
ESC = "\x1b]0;TITLE\x07\x1b[2J\x1b[31m\x9b31m\u202e\u2028"


def _handshake(**changes: Any) -> dict[str, Any]:
    return {"protocol_version": m.PROTOCOL_VERSION, "server_version": "0.1.0", "chunk_size": 256, "transports": [],
            "arena_path": "", "arena_size": 0, "heartbeat_s": 1.0, "session_timeout_s": 3.0,
            "max_message_size": 16 << 20, **changes}


def _status(**changes: Any) -> dict[str, Any]:
    arena = {"path": "/dev/shm/x", "capacity": 100, "used": 1, "chunks": 1, "free_extents": 1, "largest_free": 1,
             "evictions": 0}
    return {"server_version": "0.1.0", "protocol_version": m.PROTOCOL_VERSION, "url": "ipc://x", "pid": 1,
            "uptime_s": 1.0, "chunk_size": 256, "sessions": 1, "contexts": [], "arena": arena, "transports": [],
            "lookups": 0, "lookup_chunks": 0, "lookup_hits": 0, "leases": 0, "leased_chunks": 0, "reservations": 0,
            "errors": 0, "hook_errors": 0, **changes}


class FakeServer:
    """Answers every connection's requests in a thread: ``replies[name]`` (a dict, encoded as
    the reply's payload), ``ok`` for anything else; counts the requests it got by name."""

    def __init__(self, path: Path, replies: dict[str, Any]) -> None:
        self.url = f"ipc://{path}"
        self.replies = replies
        self.seen: dict[str, int] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        reader = FrameReader(1 << 24)
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                reader.feed(data)
                while (frames := reader.next()) is not None:
                    rid, name = frames[0], frames[1].decode()
                    self.seen[name] = self.seen.get(name, 0) + 1
                    reply = self.replies.get(name, {})  # a dict, or a function of the request's payload
                    payload = msgspec.msgpack.encode(reply(bytes(frames[2])) if callable(reply) else reply)
                    conn.sendall(b"".join(bytes(b) for b in pack([rid, b"ok", payload])))

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Any]:
    made: list[FakeServer] = []

    def start(handshake: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
              **replies: Any) -> FakeServer:
        srv = FakeServer(tmp_path / f"fake{len(made)}.sock",
                         {"handshake": handshake or _handshake(), "status": status or _status(), **replies})
        made.append(srv)
        return srv

    yield start
    for srv in made:
        srv.close()


def _kvxfer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


def test_a_servers_text_never_drives_the_terminal(fake: Any) -> None:
    """Every string of a status reply (the version, the url, the arena's path, the metrics url,
    model names, section titles) is shown with its control characters escaped, by ``status`` and
    by ``top``; ``status --json`` escapes them as JSON does, and writes a NaN figure as null; a
    hit rate of impossible figures is shown as "-"."""
    ctx = {"instance_id": 1, "model_name": "m" + ESC, "world_size": 1, "rank": 0, "transport": "t" + ESC,
           "layout": "flash_attn", "num_layers": 1, "block_size": 16, "hidden_dim_size": 8, "dtype": "bfloat16",
           "use_mla": False, "num_blocks": 4, "chunk_bytes": 1024, "client_pid": 1, "stores": 0, "retrieves": 0}
    srv = fake(status=_status(server_version="0.1.0" + ESC, url="ipc://x" + ESC, metrics_url="http://h" + ESC,
                              arena={**_status()["arena"], "path": "/dev/shm/x" + ESC}, contexts=[ctx],
                              sections={"s" + ESC: {"k" + ESC: "v" + ESC}}, uptime_s=float("nan"),
                              lookup_chunks=1, lookup_hits=5))
    for args in (["status"], ["top", "--once"]):
        out = _kvxfer(*args, "--url", srv.url)
        assert out.returncode == 0, out.stderr
        assert not any(c in out.stdout for c in "\x1b\x07\x9b\u202e\u2028"), (args, out.stdout)
        assert "\\x1b]0;TITLE\\x07" in out.stdout, (args, out.stdout)  # shown, escaped
        assert "500.0%" not in out.stdout, "a hit rate of more hits than chunks asked is no rate"
    out = _kvxfer("status", "--json", "--url", srv.url)
    assert out.returncode == 0 and "NaN" not in out.stdout
    assert out.stdout.isascii(), "JSON escapes every character a terminal may act on (8-bit C1 controls too)"
    parsed = msgspec.json.decode(out.stdout)
    assert parsed["server_version"] == "0.1.0" + ESC and parsed["uptime_s"] is None
    assert parsed["url"] == "ipc://x" + ESC


def test_a_status_reply_with_more_entries_than_a_server_sends_is_refused(fake: Any) -> None:
    """A server sends at most m.MAX_STATUS_ENTRIES status sections of as many entries each: a
    reply with two million (16 MB, which took ``top`` a gigabyte) is refused as it is decoded."""
    many = {f"{i:x}": "" for i in range(2_000_000)}
    srv = fake(status=_status(sections={"s": many}))
    with CacheClient(srv.url, timeout=30) as client, pytest.raises(KvxferError, match="length <= 64"):
        client.status()
    srv = fake(status=_status(sections={f"s{i}": {} for i in range(m.MAX_STATUS_ENTRIES + 1)}))
    with CacheClient(srv.url, timeout=30) as client, pytest.raises(KvxferError, match="length <= 64"):
        client.status()
    # every map and list of the reply is bounded so, not only the sections
    tier = {"name": "l2", "store": "x", "url": "", "state": "up", "store_stats": {str(i): "" for i in range(65)}}
    sample = {"name": "kvxfer_x", "kind": "gauge", "value": 1.0, "labels": {str(i): "" for i in range(65)}}
    for spoilt in ({"tiers": [tier]}, {"plugin_metrics": [sample]}, {"errors_by_code": {str(i): 1 for i in range(65)}},
                   {"models": [{"model": str(i)} for i in range(m.MAX_STATUS_ITEMS + 1)]}):
        srv = fake(status=_status(**spoilt))
        with CacheClient(srv.url, timeout=30) as client, pytest.raises(KvxferError, match="length <= "):
            client.status()


@pytest.mark.parametrize("timing", [{"heartbeat_s": float("nan")}, {"heartbeat_s": 0.0}, {"heartbeat_s": -1.0},
                                    {"session_timeout_s": float("inf")}, {"session_timeout_s": 0.0},
                                    {"heartbeat_s": 3600.0, "session_timeout_s": 0.5}])
def test_a_handshake_with_impossible_session_timing_is_refused(fake: Any, timing: dict[str, float]) -> None:
    """The client pings every ``heartbeat_s`` the server announces: NaN killed its I/O thread
    (heartbeats then stopped, the session was lost), 0 or less made it ping a thousand times a
    second. Such a handshake is refused, and nothing more is sent."""
    srv = fake(handshake=_handshake(**timing))
    with pytest.raises(KvxferError, match="heartbeat_s|session_timeout_s"):
        CacheClient(srv.url, timeout=5).status()
    assert srv.seen.get("ping", 0) == 0 and srv.seen.get("status", 0) == 0, srv.seen


@pytest.mark.parametrize("field", [{"chunk_size": 0}, {"chunk_size": -16}, {"arena_size": -1},
                                   {"max_message_size": 0}, {"max_lease_s": float("nan")},
                                   {"max_name_length": -1}, {"transports": ["t"] * (m.MAX_HANDSHAKE_NAMES + 1)},
                                   {"features": ["f" * (m.MAX_STATUS_TEXT + 1)]},
                                   {"arena_path": "/" * (m.MAX_PATH_TEXT + 1)}],
                         ids=["chunk0", "chunk-16", "arena-1", "message0", "lease-nan", "name-1", "transports",
                              "feature", "path"])
def test_a_handshake_out_of_any_servers_range_is_refused(fake: Any, field: dict[str, Any]) -> None:
    """A chunk size of 0 or less was taken (0 % block_size is 0): vLLM's scheduler connected,
    then raised out of every request's lookup; millions of transport names were kept for the
    client's life (a 20 MiB reply held 358 MiB in each engine process). Every field of a
    handshake reply is bounded as it is decoded, and nothing more is sent."""
    srv = fake(handshake=_handshake(**field))
    with pytest.raises(KvxferError, match=f"\\$\\.{next(iter(field))}"):
        CacheClient(srv.url, timeout=5).status()
    assert srv.seen.get("ping", 0) == 0 and srv.seen.get("status", 0) == 0, srv.seen


@pytest.mark.parametrize("slots", [[], [[-1, 0]], [[0, 0], [0, 4096]], [[0, 0], [5, 4096]], [[0, 1], [1, 4096]]],
                         ids=["none", "negative", "repeated", "past-the-request", "misaligned"])
def test_reserve_replies_that_do_not_account_for_each_chunk_load_nothing(fake: Any, tmp_path: Path,
                                                                          slots: list[list[int]]) -> None:
    """A read reservation's slots and missing chunks must name each chunk of the request once,
    at offsets the chunk's dtype can view. A reply of no slots and nothing missing had the
    retrieve reported loaded with the engine's blocks untouched (stale KV for attention to read),
    and an index out of range or an offset off the dtype's alignment raised an IndexError or a
    RuntimeError that vLLM's worker let through (the engine died). Each is a ProtocolError now,
    nothing is copied, and the reservation is given back."""
    import torch

    from kvxfer.arena import Arena

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    arena = Arena.create(1 << 20, shm)
    try:
        def register(payload: bytes) -> dict[str, Any]:
            reg = msgspec.msgpack.decode(msgspec.msgpack.decode(payload, type=m.Register).registration)
            return {"instance_id": reg["instance_id"], "chunk_bytes": 4096}

        srv = fake(handshake=_handshake(chunk_size=16, transports=["cpu_gather"], arena_path=str(arena.path),
                                        arena_size=arena.size),
                   register=register, reserve_read={"reservation_id": 7, "slots": slots, "missing": []},
                   ping={"server_time": 0.0})
        layers = [torch.full((2, 8, 16, 2, 8), 7.0) for _ in range(2)]  # flash_attn, 4096 bytes a chunk
        with CacheClient(srv.url, timeout=10) as client:
            kv = client.register(layers, model_name="m", block_size=16, transport="cpu_gather")
            with pytest.raises(KvxferError, match="do not name each of them once|a slot this context cannot use"):
                kv.submit_retrieve([bytes([i]) * 16 for i in range(2)], [2, 3]).result(10)
            assert all(bool((layer == 7.0).all()) for layer in layers), "a block was written"
            assert wait_for(lambda: srv.seen.get("commit_read", 0) == 1), srv.seen  # given back
            kv.close()
    finally:
        arena.close()


def test_results_of_server_driven_requests_must_account_for_each_chunk() -> None:
    """A server-driven store or retrieve result names each chunk of the request once (a
    retrieve of two chunks answered ``loaded=[0]``, nothing missing, was taken as one chunk
    loaded and the other never mentioned)."""
    from kvxfer.errors import ProtocolError
    from kvxfer.transport._server_driven import _check_result

    retrieve = m.Retrieve(1, [b"a" * 16, b"b" * 16], [0, 1])
    _check_result(retrieve, m.RetrieveResult([1], [0]), "u")
    for bad in (m.RetrieveResult([0], []), m.RetrieveResult([0, 1], [1]), m.RetrieveResult([0, 2], [])):
        with pytest.raises(ProtocolError, match="do not name each of them once"):
            _check_result(retrieve, bad, "u")
    store = m.Store(1, [b"a" * 16, b"b" * 16], [0, 1])
    _check_result(store, m.StoreResult([0], [1], []), "u")
    with pytest.raises(ProtocolError, match="do not name each of them once"):
        _check_result(store, m.StoreResult([0, 0], [], [1]), "u")


def wait_for(cond: Any, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def test_one_long_name_does_not_widen_every_row_of_status(fake: Any) -> None:
    """``kvxfer status`` padded each row to the widest cell: 2,000 registrations and one model name
    of 256 KiB in a 0.7 MB reply printed 525 MB. A column is padded to MAX_CELL characters at most;
    a longer cell is printed whole, once."""
    from kvxfer.text_table import MAX_CELL

    ctx = {"instance_id": 1, "model_name": "m", "world_size": 1, "rank": 0, "transport": "t", "layout": "flash_attn",
           "num_layers": 1, "block_size": 16, "hidden_dim_size": 8, "dtype": "bfloat16", "use_mla": False,
           "num_blocks": 4, "chunk_bytes": 1024, "client_pid": 1, "stores": 0, "retrieves": 0}
    contexts = [{**ctx, "instance_id": i} for i in range(2000)] + [{**ctx, "model_name": "x" * (256 << 10)}]
    srv = fake(status=_status(contexts=contexts))
    out = _kvxfer("status", "--url", srv.url)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout) < 2001 * 2 * MAX_CELL + (256 << 10), len(out.stdout)
    assert "x" * (256 << 10) in out.stdout
