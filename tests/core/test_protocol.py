"""The wire protocol: codec round trips, handshake, typed error replies, raw bad frames."""

from __future__ import annotations

import msgspec
import pytest
import struct
import time

from kvxfer.mq.stream import MAX_FRAMES, FrameReader, FramingError, pack
from kvxfer.testing.wire import RawConnection

from kvxfer.errors import (
    InvalidRequest,
    NoSession,
    RemoteError,
    UnknownInstance,
    UnknownRequest,
    VersionMismatch,
    remote_error,
)
from kvxfer.mq.client import MQClient
from kvxfer.protocol import REQUESTS, HandlerKind, codec
from kvxfer.protocol import messages as m
from kvxfer_core_helpers import wait_until

H = b"\x01" * 16

#: One example payload and reply per request. A new request must add its examples here.
EXAMPLES: dict[str, tuple[msgspec.Struct, msgspec.Struct]] = {
    "handshake": (
        m.Handshake(m.PROTOCOL_VERSION, "test", 42),
        m.HandshakeReply(1, "0.1.0", 256, ["cpu_gather"], "/dev/shm/a", 1 << 20, 1.0, 3.0, 16 << 20),
    ),
    "ping": (m.Ping(), m.Pong(123.5)),
    "goodbye": (m.Goodbye(), m.Empty()),
    "register": (
        m.Register("cpu_gather", msgspec.Raw(codec.encode(m.Registration(
            instance_id=7, model_name="m", world_size=2, rank=1, layout="flash_attn", num_layers=4,
            num_blocks=8, block_size=16, hidden_dim_size=128, dtype="bfloat16", use_mla=False)))),
        m.RegisterReply(7, 4096),
    ),
    "unregister": (m.Unregister(7), m.Empty()),
    "lookup": (m.Lookup("m", 2, [H, H[::-1]], 5.0), m.LookupReply(2, 9)),
    "release_lease": (m.ReleaseLease(9), m.Empty()),
    "reserve_write": (m.ReserveWrite(7, [H]), m.ReserveWriteReply(3, [m.Slot(0, 4096)], [1], [2])),
    "commit_write": (m.CommitWrite(7, 3, [1]), m.StoreResult([0], [1], [2])),
    "reserve_read": (m.ReserveRead(7, [H], 9), m.ReserveReadReply(4, [m.Slot(0, 8192)], [1])),
    "commit_read": (m.CommitRead(7, 4), m.Empty()),
    "store": (m.Store(7, [H], [1, 2, 3, 4], msgspec.Raw(b"\x80")), m.StoreResult([0])),
    "retrieve": (m.Retrieve(7, [H], [1, 2, 3, 4], 16, 9), m.RetrieveResult([0], [1])),
    "status": (m.StatusRequest(), m.StatusReply(
        server_version="0.1.0", protocol_version=1, url="ipc:///x", pid=1, uptime_s=1.5, chunk_size=256,
        sessions=1,
        contexts=[m.ContextStatus(7, "m", 1, 0, "cpu_gather", "flash_attn", 4, 16, 128, "bfloat16", False, 8,
                                  4096, 42, 1, 2)],
        arena=m.ArenaStatus("/dev/shm/a", 1 << 20, 4096, 1, 1, 1 << 19, 0),
        transports=[m.TransportStatus("cpu_gather", "client_driven", 1, {"k": "v"})],
        lookups=3, lookup_chunks=6, lookup_hits=4, leases=1, leased_chunks=2, reservations=0, errors=1,
        hook_errors=0, sections={"s": {"a": "b"}})),
    "clear": (m.Clear("m"), m.ClearReply(5)),
}


def test_examples_cover_the_request_table() -> None:
    assert set(EXAMPLES) == set(REQUESTS)


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_every_request_round_trips_through_the_codec(name: str) -> None:
    spec = REQUESTS[name]
    payload, reply = EXAMPLES[name]
    assert type(payload) is spec.payload and type(reply) is spec.reply
    for obj, tp in ((payload, spec.payload), (reply, spec.reply)):
        data = codec.encode(obj)
        assert codec.decode(data, tp) == obj
        # plain MessagePack: decodable without kvxfer's types (nothing pickled)
        assert isinstance(msgspec.msgpack.decode(data), dict | list)
        assert b"\x80\x04\x95" not in data  # no pickle protocol-4 header


def test_handler_kinds() -> None:
    transfer = {n for n, s in REQUESTS.items() if s.kind is HandlerKind.TRANSFER}
    assert transfer == {"register", "unregister", "store", "retrieve"}
    assert REQUESTS["lookup"].kind is HandlerKind.CONTROL


def test_request_ids_pack_as_8_bytes() -> None:
    assert codec.unpack_id(codec.pack_id(2**64 - 1)) == 2**64 - 1
    with pytest.raises(ValueError, match="8 bytes"):
        codec.unpack_id(b"abc")


def test_remote_error_maps_codes_to_types() -> None:
    assert isinstance(remote_error("unknown_instance", "gone", "store"), UnknownInstance)
    e = remote_error("version_mismatch", "no")
    assert isinstance(e, VersionMismatch) and e.code == "version_mismatch"
    other = remote_error("brand_new_code", "text", "ping")
    assert type(other) is RemoteError and "brand_new_code" in str(other) and "text" in str(other)


# --------------------------------------------------------------------------- against a real server


@pytest.fixture
def mq(server):
    c = MQClient(server.url, default_timeout=10)
    yield c
    c.close()


def test_handshake_with_another_version_is_refused_naming_both(mq) -> None:
    with pytest.raises(VersionMismatch) as info:
        mq.request(m.Handshake(m.PROTOCOL_VERSION + 98))
    msg = str(info.value)
    assert f"protocol {m.PROTOCOL_VERSION + 98}" in msg and f"speaks {m.PROTOCOL_VERSION}" in msg
    assert info.value.request == "handshake"
    # no session was opened
    with pytest.raises(NoSession, match="handshake first"):
        mq.request(m.Ping())


def test_handshake_reply(mq, server) -> None:
    reply = mq.request(m.Handshake(m.PROTOCOL_VERSION, "t", 1))
    assert reply.protocol_version == m.PROTOCOL_VERSION
    assert reply.chunk_size == server.chunk_size
    assert reply.transports == ["cpu_gather"]
    assert reply.arena_size > 0 and reply.arena_path
    assert reply.session_timeout_s > reply.heartbeat_s > 0


def test_typed_errors_carry_the_servers_message(mq) -> None:
    mq.request(m.Handshake(m.PROTOCOL_VERSION))
    with pytest.raises(UnknownInstance, match="instance 12345 is not registered"):
        mq.request(m.Unregister(12345))
    with pytest.raises(InvalidRequest, match=r"hashes\[0\]"):
        mq.request(m.Lookup("m", 1, [b"x"]))
    with pytest.raises(InvalidRequest, match="world_size"):
        mq.request(m.Lookup("m", 0, []))
    with pytest.raises(InvalidRequest, match="transport 'nope' is not loaded"):
        mq.request(m.Register("nope", msgspec.Raw(codec.encode(m.Ping()))))
    with pytest.raises(InvalidRequest, match="registration: does not decode"):
        mq.request(m.Register("cpu_gather", msgspec.Raw(codec.encode(m.Ping()))))
    assert mq.request(m.Ping()).server_time > 0  # still serving


def test_a_struct_that_is_no_request_is_refused_locally(mq) -> None:
    with pytest.raises(ValueError, match="Pong is not a request payload"):
        mq.submit(m.Pong(1.0))  # type: ignore[arg-type]  (the point: a reply is not a request)


def test_a_payload_that_does_not_decode_as_the_named_request(raw) -> None:
    """Only raw frames can name one request and carry another's payload: refused, naming both."""
    raw.call(1, b"handshake", codec.encode(m.Handshake(m.PROTOCOL_VERSION)))
    err = _error(raw.call(2, b"lookup", codec.encode(m.Ping())))
    assert err.code == "invalid_request" and "does not decode as Lookup" in err.message
    _assert_serving(raw)


# --------------------------------------------------------------------------- raw frames


class Raw:
    """A bare connection speaking the wire by hand, no kvxfer client code."""

    def __init__(self, url: str) -> None:
        self.conn = RawConnection(url)

    def send(self, frames: list[bytes]) -> None:
        self.conn.send(frames)

    def recv(self, timeout_ms: int = 5000) -> list[bytes] | None:
        return self.conn.recv(timeout_ms / 1000)

    def call(self, rid: int, name: bytes, payload: bytes) -> list[bytes]:
        self.send([codec.pack_id(rid), name, payload])
        reply = self.recv()
        assert reply is not None, f"no reply to {name!r}"
        return reply

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def raw(server):
    r = Raw(server.url)
    yield r
    r.close()


def _error(frames: list[bytes]) -> m.ErrorReply:
    assert frames[1] == codec.ERR, frames
    return codec.decode(frames[2], m.ErrorReply)


def _assert_serving(raw: Raw, rid: int = 999) -> None:
    rep = raw.call(rid, b"ping", codec.encode(m.Ping()))
    assert rep[0] == codec.pack_id(rid) and rep[1] == codec.OK, rep
    assert codec.decode(rep[2], m.Pong).server_time > 0


def test_raw_requests_without_a_session(raw) -> None:
    err = _error(raw.call(1, b"ping", codec.encode(m.Ping())))
    assert err.code == "no_session" and "handshake" in err.message


def test_raw_typed_error_replies(raw) -> None:
    ok = raw.call(1, b"handshake", codec.encode(m.Handshake(m.PROTOCOL_VERSION)))
    assert ok[:2] == [codec.pack_id(1), codec.OK]
    cases = [
        (b"no_such_request", b"", "unknown_request", "no_such_request"),
        (b"\xff\xfe\xfd", b"", "unknown_request", "unknown request"),
        (b"lookup", b"\xc1\xc1garbage", "invalid_request", "does not decode as Lookup"),
        (b"lookup", b"", "invalid_request", "does not decode"),
        (b"ping", b"\x92\x01\x02", "invalid_request", "does not decode as Ping"),
        (b"lookup", codec.encode({"model_name": 5, "world_size": 1, "hashes": []}), "invalid_request",
         "model_name"),
        (b"store", codec.encode(m.Store(77, [], [])), "unknown_instance", "77"),
    ]
    for rid, (name, payload, code, text) in enumerate(cases, start=10):
        rep = raw.call(rid, name, payload)
        assert rep[0] == codec.pack_id(rid), "the reply must echo the request id"
        err = _error(rep)
        assert (err.code, text in err.message) == (code, True), (name, payload, err)
    _assert_serving(raw)


def test_raw_bad_frames_are_answered_or_dropped_and_the_server_keeps_serving(raw) -> None:
    raw.call(1, b"handshake", codec.encode(m.Handshake(m.PROTOCOL_VERSION)))
    rid = codec.pack_id(5)
    # a request id and too few / too many frames: answered with invalid_request
    for frames in ([rid, b"ping"], [rid], [rid, b"ping", b"\x80", b"extra"]):
        raw.send(frames)
        rep = raw.recv()
        assert rep is not None and rep[0] == rid
        err = _error(rep)
        assert err.code == "invalid_request" and "3 frames" in err.message
    # no usable request id: nothing to answer with, dropped
    for frames in ([b"abc", b"ping", codec.encode(m.Ping())], [b"", b"", b""], [b"x" * 9, b"ping", b"\x80"]):
        raw.send(frames)
    _assert_serving(raw, 1000)  # the only reply is the ping's: the dropped ones sent nothing
    assert raw.recv(300) is None


def test_frames_round_trip_through_a_reader_fed_byte_by_byte() -> None:
    msgs = [[b"a"], [codec.pack_id(3), b"ping", b""], [b"x" * 70_000, b"", b"y", b"z" * 5]]
    wire = b"".join(b"".join(pack(f)) for f in msgs)
    reader = FrameReader(1 << 20)
    got = []
    for i in range(len(wire)):
        reader.feed(wire[i:i + 1])
        while (frames := reader.next()) is not None:
            got.append(frames)
    assert got == msgs and len(reader) == 0


@pytest.mark.parametrize("head, why", [
    (struct.pack("<IB", (1 << 20) + 1, 3), "over the limit"),  # refused before it is buffered
    (struct.pack("<IB", 9, 0), "0 frames"),
    (struct.pack("<IB", 30, MAX_FRAMES + 1), f"{MAX_FRAMES + 1} frames"),
    (struct.pack("<IB", 4, 3), "whose body is 4 bytes"),
    (struct.pack("<IBIII", 13 + 5, 3, 1, 1, 1) + b"abcde", "do not add up"),
])
def test_a_reader_refuses_a_malformed_message(head: bytes, why: str) -> None:
    reader = FrameReader(1 << 20)
    reader.feed(head)
    with pytest.raises(FramingError, match=why):
        reader.complete()
        reader.next()


@pytest.mark.parametrize("what", ["too long", "no frames", "lengths that do not add up"])
def test_a_malformed_stream_closes_its_connection_and_the_server_keeps_serving(server, client, what) -> None:
    """On the ipc:// wire a message whose head is wrong cannot be skipped: the server closes
    that connection at once (a message too long before it reads the body), and serves the rest."""
    head = {"too long": struct.pack("<IB", 1 << 30, 3),
            "no frames": struct.pack("<IB", 40, 0) + bytes(40),
            "lengths that do not add up": struct.pack("<IBIII", 13 + 4, 3, 8, 1, 1) + bytes(4)}[what]
    conn = RawConnection(server.url)
    try:
        conn.send_bytes(head)
        assert conn.closed(15.0), "the server kept a connection that sent a malformed message"
    finally:
        conn.close()
    assert client.ping() > 0


def test_a_flood_of_malformed_connections_does_not_flood_the_log(server, client) -> None:
    """Each malformed connection is closed; the line saying so is logged at most once a second,
    with the count of those left out (one line each once made the log grow 1 MB a second)."""
    line = "closing the connection of"
    before = server.log().count(line)
    for _ in range(300):
        conn = RawConnection(server.url)
        try:
            conn.send_bytes(struct.pack("<IB", 40, 0) + bytes(40))  # no frames
            assert conn.closed(15.0)
        finally:
            conn.close()
    assert client.ping() > 0
    time.sleep(1.1)  # the next line is due: it counts the ones left out
    conn = RawConnection(server.url)
    try:
        conn.send_bytes(struct.pack("<IB", 40, 0) + bytes(40))
        assert conn.closed(15.0)
    finally:
        conn.close()
    assert wait_until(lambda: "more since the last such line" in server.log(), 15), server.log()[-2000:]
    assert server.log().count(line) - before <= 3, server.log()[-2000:]


def test_a_connection_closed_mid_message_costs_nothing(server, client) -> None:
    conn = RawConnection(server.url)
    conn.send_bytes(b"".join(pack([codec.pack_id(1), b"ping", codec.encode(m.Ping())]))[:-3])
    conn.close()
    assert client.ping() > 0


def test_many_garbage_requests_then_normal_service(raw, client) -> None:
    raw.call(1, b"handshake", codec.encode(m.Handshake(m.PROTOCOL_VERSION)))
    import random

    rng = random.Random(7)
    names = list(REQUESTS) + ["", "x" * 300]
    for i in range(200):
        name = rng.choice(names).encode()
        payload = rng.randbytes(rng.randrange(0, 64))
        rep = raw.call(100 + i, name, payload)
        assert rep[0] == codec.pack_id(100 + i)
        assert rep[1] in (codec.OK, codec.ERR)
        if rep[1] == codec.ERR:
            assert _error(rep).code in {"invalid_request", "unknown_request", "unknown_instance"}
    assert client.ping() > 0
    assert client.status().errors > 0
