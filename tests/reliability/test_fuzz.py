"""Bad input: property-based fuzzing of every request type with raw frames from a bare DEALER.

For every request in :data:`kvxfer.protocol.table.REQUESTS`, hypothesis sends random bytes,
random MessagePack values, and payloads of the right shape whose fields are wrong (wrong
types, out-of-range integers, bad hash lengths, unknown instance and reservation ids,
registrations with wrong dtypes, layouts and sizes). Every request must get exactly one reply:
the decoded reply type, or a typed error whose code is a known one and never ``internal``. The
server must keep serving and the reference chunks stored before must stay bit-exact.

Bounded: ``KVXFER_FUZZ_EXAMPLES`` examples per request type (default 60), ``deadline=None``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relkit import RawPeer, Writer, key

from kvxfer.errors import _BY_CODE
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.protocol.table import REQUESTS
from kvxfer.testing.server import ServerProcess

EXAMPLES = int(os.environ.get("KVXFER_FUZZ_EXAMPLES", "60"))
MAX_MESSAGE = 1 << 20
#: codes a malformed request may get; "internal" (a handler crashed) is a bug
TYPED_CODES = set(_BY_CODE) - {"internal"}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


class Env:
    """The fuzzed server, its reference chunks, and the ids a fuzzer should sometimes hit."""

    def __init__(self, server: ServerProcess, ref: Writer, keys: list[bytes], lease_id: int, peer: RawPeer,
                 instance_id: int) -> None:
        self.server, self.ref, self.keys, self.lease_id = server, ref, keys, lease_id
        self.peer, self.instance_id = peer, instance_id

    def registration(self) -> bytes:
        reg = dict(msgspec.structs.asdict(self.ref.ctx.registration()), instance_id=self.instance_id)
        return codec.encode(m.Register("cpu_gather", msgspec.Raw(codec.encode(reg))))

    def keep_registered(self) -> None:
        """Register the fuzzer's instance again if a fuzzed request dropped it (legitimately:
        ``unregister`` of its id, or a lost session: a fuzzed ``goodbye`` ends it, and the peer
        opens a new one only half a second after its last handshake)."""
        status, payload = self.peer.call(b"commit_read", codec.encode(m.CommitRead(self.instance_id, 0)))
        code = codec.ERROR_DECODER.decode(payload).code
        if code == "no_session":
            self.peer.handshake()
        if code in ("no_session", "unknown_instance"):
            status, payload = self.peer.call(b"register", self.registration())
            assert status == codec.OK, codec.ERROR_DECODER.decode(payload)

    def check_reference(self) -> None:
        res, bad = self.ref.retrieve(self.keys)
        assert res.loaded == list(range(len(self.keys))) and bad == [], "a stored chunk changed or vanished"


@pytest.fixture(scope="module")
def env():
    from kvxfer import CacheClient

    with ServerProcess(l1_size="8MiB", chunk_size=16, transports="cpu_gather",
                       extra_args=["--max-message-size", str(MAX_MESSAGE), "--session-timeout", "60"]) as server:
        client = CacheClient(server.url, timeout=20)
        ref = Writer(client, model="ref")
        keys = [key("ref", j) for j in range(8)]
        assert ref.store(keys).stored == list(range(8))
        # pinned, so that legitimate requests (clear, eviction by the fuzzer's stores) keep them;
        # the lease is this client's session's, which must outlive a stall of its heartbeats on a
        # loaded machine (at the 3 s default it ended, its lease with it, and a fuzzed clear then
        # dropped the chunks: hence --session-timeout 60)
        lease_id = client.lookup_and_lease("ref", hashes=keys, lease_s=600).lease_id
        peer = RawPeer(server.url)
        peer.handshake()
        # the fuzzer's own registration (same model and layout as the reference chunks), so
        # that well-formed requests reach the deep end of the handlers
        e = Env(server, ref, keys, lease_id, peer, 777_000_001)
        e.keep_registered()
        yield e
        peer.close()
        client.close()
        log = server.log()
    assert "Traceback" not in log, log[-4000:]


# --------------------------------------------------------------------------- strategies

INTS = st.one_of(
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.sampled_from([0, 1, -1, 2, 7, 16, 64, (1 << 31), (1 << 32) + 1, (1 << 62), (1 << 63) - 1, 1 << 63,
                     (1 << 64) - 1, -(1 << 63)]),
    st.integers(0, 300),  # small numbers (reservation and lease ids are random 63-bit ones)
)
MSGPACK_ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True), st.text(max_size=20),
              st.binary(max_size=40)),
    lambda children: st.one_of(st.lists(children, max_size=6),
                               st.dictionaries(st.one_of(st.text(max_size=12), INTS), children, max_size=6)),
    max_leaves=20,
)
HASHES = st.lists(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=80),
                            st.sampled_from([key("ref", j) for j in range(8)])), max_size=12)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "bool",
                          "torch.bfloat16", "complex64", "", "float64", "uint8", "\x00", "bfloat16" * 40])
LAYOUTS = st.sampled_from(["flash_attn", "flashinfer", "mla", "FLASH_ATTN", "", "paged", "mla\x00"])


def registrations(env: Env) -> st.SearchStrategy[bytes]:
    """Registrations of the right shape with wrong values (and sometimes right ones)."""
    base = msgspec.structs.asdict(env.ref.ctx.registration())

    def build(overrides: dict, drop: list[str]) -> bytes:
        reg = {**base, **overrides}
        for k in drop:
            reg.pop(k, None)
        return codec.encode(reg)

    fields = {
        "instance_id": st.one_of(INTS, st.just(env.instance_id), st.just(env.ref.ctx.instance_id)),
        "model_name": st.one_of(st.text(max_size=30), st.just("ref"), INTS),
        "world_size": INTS, "rank": INTS, "layout": st.one_of(LAYOUTS, INTS),
        "num_layers": st.one_of(INTS, st.integers(1, 4)),
        "num_blocks": st.one_of(INTS, st.integers(1, 128)),
        "block_size": st.one_of(INTS, st.sampled_from([1, 2, 4, 8, 16, 32])),
        "hidden_dim_size": st.one_of(INTS, st.integers(1, 512)),
        "dtype": st.one_of(DTYPES, INTS), "use_mla": st.one_of(st.booleans(), INTS, st.text(max_size=3)),
        "device": st.one_of(st.text(max_size=8), st.none()),
    }
    fresh = st.integers(1, (1 << 63) - 1)
    one_wrong = st.sampled_from(sorted(fields)).flatmap(
        lambda f: st.builds(lambda v, iid: {f: v} if f == "instance_id" else {f: v, "instance_id": iid},
                            fields[f], fresh))
    many_wrong = st.fixed_dictionaries({}, optional=fields)
    return st.builds(build, st.one_of(one_wrong, one_wrong, many_wrong),
                     st.lists(st.sampled_from(sorted(base)), max_size=1))


def field_values(env: Env, name: str, t: mi.Type, deep: bool = False) -> st.SearchStrategy:
    """Values of the right type (biased to interesting ones) or, unless ``deep``, of another type."""
    wrong = MSGPACK_ANY
    if name == "lease_id":
        # leases are not owned by a session: releasing the reference lease is legal, so spare it
        right = INTS.filter(lambda v: v != env.lease_id)
        wrong = wrong.filter(lambda v: v != env.lease_id)
    elif name == "instance_id":
        right = st.just(env.instance_id) if deep else st.one_of(
            INTS, st.just(env.instance_id), st.just(env.ref.ctx.instance_id))
    elif name == "hashes":
        right = HASHES
    elif name in ("block_ids", "failed"):
        right = st.lists(INTS, max_size=40)
    elif name == "registration":
        right = registrations(env).map(msgspec.Raw)
    elif name == "params":
        right = st.one_of(st.just(msgspec.Raw(b"")), MSGPACK_ANY.map(lambda v: msgspec.Raw(codec.encode(v))))
    elif name == "transport":
        right = st.just("cpu_gather") if deep else st.sampled_from(["cpu_gather", "cuda_ipc", "", "auto", "../x"])
    elif name == "model_name":
        right = st.one_of(st.just("ref"), st.text(max_size=20))
    elif name == "protocol_version":
        right = st.one_of(st.just(m.PROTOCOL_VERSION), INTS)
    elif isinstance(t, mi.IntType):
        right = INTS
    elif isinstance(t, mi.FloatType):
        right = st.one_of(st.floats(allow_nan=True, allow_infinity=True), INTS)
    elif isinstance(t, mi.StrType):
        right = st.text(max_size=40)
    else:
        right = MSGPACK_ANY
    return right if deep else st.one_of(right, right, wrong)


def shaped_payloads(env: Env, name: str) -> st.SearchStrategy[bytes]:
    """A map with the payload's fields (some missing, some extra), wrong values mixed in."""
    info = mi.type_info(REQUESTS[name].payload)
    fields = {f.encode_name: field_values(env, f.name, f.type) for f in info.fields}
    required = {f.encode_name: fields[f.encode_name] for f in info.fields if f.required}
    optional = {f.encode_name: fields[f.encode_name] for f in info.fields if not f.required}
    complete = st.fixed_dictionaries(required, optional=optional)
    partial = st.fixed_dictionaries({}, optional=fields)
    extra = st.dictionaries(st.text(max_size=10), MSGPACK_ANY, max_size=3)
    maps = st.builds(lambda a, b: {**b, **a}, st.one_of(complete, complete, partial), extra)
    as_list = st.builds(lambda d: list(d.values()), complete)  # array form: wrong for non-array Structs
    return st.one_of(maps, maps, maps, as_list).map(codec.encode)


def deep_payloads(env: Env, name: str) -> st.SearchStrategy[bytes]:
    """Well-typed payloads naming the fuzzer's registered instance, with fuzzed values: they
    pass decoding and reach the handlers' own checks (ranges, ids, hash sizes, registrations)."""
    info = mi.type_info(REQUESTS[name].payload)
    required = {f.encode_name: field_values(env, f.name, f.type, deep=True) for f in info.fields if f.required}
    optional = {f.encode_name: field_values(env, f.name, f.type, deep=True) for f in info.fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional).map(codec.encode)


def payloads(env: Env, name: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        MSGPACK_ANY.map(codec.encode),
        shaped_payloads(env, name),
        deep_payloads(env, name),
        deep_payloads(env, name),
    )


def nested(depth: int, leaf: bytes = b"\xc0") -> bytes:
    """MessagePack of ``depth`` arrays nested in each other around ``leaf``."""
    return b"\x91" * depth + leaf


def with_field(fields: dict[str, bytes]) -> bytes:
    """A MessagePack map of already-encoded values."""
    out = bytearray(b"\xde" + len(fields).to_bytes(2, "big"))
    for k, v in fields.items():
        out += codec.encode(k) + v
    return bytes(out)


# --------------------------------------------------------------------------- checks


def check_reply(name: str, status: bytes, payload: bytes) -> str:
    """The reply is the request's reply type or a typed error; returns the code ("ok" or the error's)."""
    if status == codec.OK:
        codec.decode(payload, REQUESTS[name].reply)
        return "ok"
    assert status == codec.ERR, f"unknown reply status {status!r}"
    err = codec.ERROR_DECODER.decode(payload)
    assert err.code in TYPED_CODES, f"{name}: untyped or internal error {err.code}: {err.message}"
    assert err.message
    return err.code


@pytest.mark.parametrize("name", list(REQUESTS))
def test_every_request_type_survives_fuzzing(env, name):
    codes: dict[str, int] = {}

    @FUZZ
    @given(data=st.data())
    def run(data):
        env.keep_registered()
        payload = data.draw(payloads(env, name))
        status, reply = env.peer.call(name.encode(), payload)
        code = check_reply(name, status, reply)
        codes[code] = codes.get(code, 0) + 1

    run()
    print(f"\n{name}: {sorted(codes.items())}")
    # random payloads were refused with a typed error at least once (the fuzzer reached the
    # validation), and the server is alive, answers others, and changed no stored chunk
    assert codes.get("invalid_request", 0) > 0, codes
    env.check_reference()
    assert env.ref.client.ping() > 0


@FUZZ
@given(name=st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode)),
       payload=st.binary(max_size=64))
def test_unknown_request_names_get_typed_errors(env, name, payload):
    if name.decode("utf-8", "replace") in REQUESTS:
        return
    status, reply = env.peer.call(name, payload)
    assert status == codec.ERR
    assert codec.ERROR_DECODER.decode(reply).code == "unknown_request"


@pytest.mark.parametrize("name", list(REQUESTS))
def test_deeply_nested_messagepack_is_an_invalid_request(env, name):
    """100,000 nested arrays (deeper than any decoder recursion limit), as the whole payload, in
    an unknown field, in a known field, and for register in the embedded registration: each is
    answered invalid_request (never internal) and the server logs no traceback."""
    deep = nested(100_000)
    payloads = [deep, with_field({"zz_unknown": deep}), with_field({"hashes": deep, "zz": deep})]
    if name == "register":
        payloads.append(with_field({"transport": codec.encode("cpu_gather"), "registration": deep}))
    for payload in payloads:
        status, reply = env.peer.call(name.encode(), payload)
        assert status == codec.ERR
        err = codec.ERROR_DECODER.decode(reply)
        assert err.code == "invalid_request", (name, err)
    assert env.ref.client.ping() > 0


def test_fuzzed_requests_from_a_connection_without_session(env):
    """Before a handshake every request but handshake gets no_session (or invalid_request)."""
    peer = RawPeer(env.server.url)
    try:
        for name in REQUESTS:
            if name == "handshake":
                continue
            default = REQUESTS[name].payload
            try:
                payload = codec.encode(default())
            except TypeError:
                payload = codec.encode({})
            rid = peer.send(name.encode(), payload)
            status, reply = peer.recv(rid)
            assert status == codec.ERR
            assert codec.ERROR_DECODER.decode(reply).code in ("no_session", "invalid_request")
    finally:
        peer.close()
    env.check_reference()


def test_oversized_messages_close_their_connection_and_the_server_keeps_serving(env):
    """A message above --max-message-size is refused as soon as its head is read (nothing of it
    buffered or decoded, no reply): the server closes that connection and keeps serving
    everyone, the same client on a new connection included."""
    for name in ("status", "lookup", "register", "reserve_write"):
        peer = RawPeer(env.server.url)
        try:
            peer.handshake()
            try:
                peer.send(name.encode(), os.urandom(MAX_MESSAGE + 4096))
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed before the body was all sent
            assert peer.conn.closed(15.0), "the connection of an oversized message stayed open"
        finally:
            peer.close()
    peer = RawPeer(env.server.url)
    try:
        peer.handshake()
        status, reply = peer.call(b"status", codec.encode(m.StatusRequest()))
        assert status == codec.OK
        big_ok = codec.encode(m.Lookup("ref", 1, [key("ref", 0)] * 1000))
        assert len(big_ok) < MAX_MESSAGE
        status, reply = peer.call(b"lookup", big_ok)
        assert status == codec.OK and codec.decode(reply, m.LookupReply).hits == 1000
    finally:
        peer.close()
    env.check_reference()


class _Evil:
    """Unpickling this creates ``self.path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_payloads_are_rejected_and_never_loaded(env, tmp_path):
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Evil(probe)))  # the payload works when something unpickles it
    assert probe.exists()

    marker = tmp_path / "marker"
    blobs = [pickle.dumps(_Evil(marker), protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    for name in REQUESTS:
        for blob in blobs:
            status, reply = env.peer.call(name.encode(), blob)
            assert status == codec.ERR, f"{name} accepted a pickle"
            assert codec.ERROR_DECODER.decode(reply).code == "invalid_request"
    # a pickle where the protocol carries opaque bytes: a registration and transport params
    for blob in blobs:
        for frame in (codec.encode(m.Register("cpu_gather", msgspec.Raw(codec.encode(blob)))),
                      codec.encode({"transport": "cpu_gather", "registration": blob})):
            status, reply = env.peer.call(b"register", frame)
            assert status == codec.ERR
            assert codec.ERROR_DECODER.decode(reply).code == "invalid_request"
        status, reply = env.peer.call(b"store", codec.encode(
            m.Store(env.instance_id, [key("ref", 0)], [0], msgspec.Raw(codec.encode(blob)))))
        assert status == codec.ERR
    assert not marker.exists(), "a pickled payload was loaded"
    env.check_reference()
