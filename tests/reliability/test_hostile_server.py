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

    def __init__(self, path: Path, replies: dict[str, dict[str, Any]]) -> None:
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
                    payload = msgspec.msgpack.encode(self.replies.get(name, {}))
                    conn.sendall(b"".join(bytes(b) for b in pack([rid, b"ok", payload])))

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Any]:
    made: list[FakeServer] = []

    def start(handshake: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> FakeServer:
        srv = FakeServer(tmp_path / f"fake{len(made)}.sock",
                         {"handshake": handshake or _handshake(), "status": status or _status()})
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
