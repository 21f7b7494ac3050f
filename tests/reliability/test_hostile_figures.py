"""Hostile clients and neighbours against what the server shows and remembers: the Prometheus
endpoint (any local user can open TCP connections to it), the names that ``kvxfer status`` and
``kvxfer top`` print on an operator's terminal, the figures kept per model name, the lookup keys
the L2 tier remembers, and the chunk format an L2 header records.

Each test reproduces something that worked on an earlier server (real server processes, raw
frames, real sockets, the real CLI) and checks that it no longer does. One server serves them
all: metrics on, an fs L2 store, names up to 64 KiB (so that a leak per name shows in RSS).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import msgspec
import pytest
from relkit import RawPeer, Writer, proc_kib, threads, wait_until

from kvxfer import CacheClient
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.server.metrics import MAX_REQUEST_HEAD, MAX_SCRAPERS, MAX_SCRAPES_PER_S, SCRAPE_CONNECTION_S
from kvxfer.testing.server import ServerProcess

NAME_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    l2 = tmp_path_factory.mktemp("l2")
    with ServerProcess(l1_size="32MiB", chunk_size=64, transports="cpu_gather", extra_args=[
            "--metrics-port", "0", "--metrics-max-models", "2", "--max-name-length", str(NAME_LIMIT),
            "--l2", "fs", "--l2-url", f"file://{l2}?max_size=64MiB"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[CacheClient]:
    with CacheClient(server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def ref(client: CacheClient) -> Writer:
    return Writer(client, model="ref")


def registration(ref: Writer, instance_id: int, **fields: object) -> bytes:
    """A Register of ``ref``'s layout with ``fields`` replaced, as raw bytes."""
    reg = {**msgspec.structs.asdict(ref.ctx.registration()), "instance_id": instance_id, **fields}
    return codec.encode(m.Register("cpu_gather", msgspec.Raw(codec.encode(reg))))


def kvxfer_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


# --------------------------------------------------------------------------- the metrics endpoint


def test_the_metrics_endpoint_holds_a_bounded_number_of_connections(server: ServerProcess, client: CacheClient):
    """Any local user can connect to the metrics port. 200 connections that send nothing once
    took 200 threads of the server (one each, waiting forever); now at most MAX_SCRAPERS are
    served at once, the others are closed as they come, and a served one is cut after
    SCRAPE_CONNECTION_S: scrapes work again afterwards."""
    url = client.status().metrics_url
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    before = threads(server.pid)
    # 5 times the bound (the server takes 10 connections a second: 200 took this test 30 s)
    idle = [socket.create_connection((host, int(port)), timeout=60) for _ in range(5 * MAX_SCRAPERS)]
    try:
        wait_until(lambda: threads(server.pid) >= before + min(MAX_SCRAPERS, 1), 30, "a connection served")
        time.sleep(1.0)  # the accept loop has seen them all
        # (+2: the store's own threads may start one meanwhile, e.g. to refresh its figures)
        assert threads(server.pid) <= before + MAX_SCRAPERS + 2, "a thread per idle metrics connection"
        # the server cuts a connection that never sent its request
        served = idle[0]
        served.settimeout(SCRAPE_CONNECTION_S + 30)
        assert served.recv(1) == b"", "the idle connection was not closed"
    finally:
        for s in idle:
            s.close()
    text = wait_until(lambda: _scrape(url), 30, "a scrape after the idle connections")
    assert "kvxfer_sessions" in text


def test_connections_that_never_finish_a_request_do_not_keep_a_scraper_out(server: ServerProcess,
                                                                             client: CacheClient):
    """MAX_SCRAPERS connections that send the start of a request and no more held every slot:
    scrapes were refused until SCRAPE_CONNECTION_S cut them. A newcomer now takes the place of
    the oldest such connection, so a scrape is answered while they stay; one served is never
    cut for a newcomer."""
    url = client.status().metrics_url
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    slow = []
    try:
        for _ in range(2 * MAX_SCRAPERS):  # more than the slots, kept open, each half a request
            s = socket.create_connection((host, int(port)), timeout=60)
            s.sendall(b"GET /metrics HTTP/1.0\r\nX-Slow: ")
            slow.append(s)
        t0 = time.monotonic()
        for _ in range(3):
            assert "kvxfer_sessions" in _scrape(url), "a scrape was refused while half-sent requests held the slots"
        assert time.monotonic() - t0 < SCRAPE_CONNECTION_S, "scrapes waited for the slow connections' deadline"
    finally:
        for s in slow:
            s.close()


def test_a_request_head_past_its_bound_is_refused_before_it_is_parsed(server: ServerProcess, client: CacheClient):
    """The standard library takes a request line and 100 header lines of 64 KiB each: parsing
    one such request of 6.5 MB, repeated at the pace the endpoint accepts, took about half a core
    of the server's interpreter (52 ms of CPU each on this VM against 1.5 ms now) and slowed every
    client's lookups behind the interpreter lock. Past MAX_REQUEST_HEAD bytes a request is
    answered 431 without its figures; a scraper's request is served as ever."""
    url = client.status().metrics_url
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    for head in (b"X-A: " + b"a" * 65529 + b"\r\n") * 99, b"X-B: " + b"b" * MAX_REQUEST_HEAD + b"\r\n":
        with socket.create_connection((host, int(port)), timeout=30) as s:
            try:
                s.sendall(b"GET /metrics HTTP/1.0\r\n" + head + b"\r\n")
            except OSError:
                pass  # answered and closed before the whole head was sent
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 431 "), reply[:200]
        assert b"kvxfer_sessions" not in reply
    assert "kvxfer_sessions" in _scrape(url)


def test_scrapes_in_a_loop_are_paced(server: ServerProcess, client: CacheClient):
    """Each answer costs the server's loop a snapshot and its process ~10 ms of interpreter time:
    8 local scrapers in a loop once took a whole core and made lookups 6-60x slower. Connections
    (one request each) are now taken at most MAX_SCRAPES_PER_S a second in all."""
    import threading

    url = client.status().metrics_url
    answers: list[float] = []
    stop = time.monotonic() + 2.0

    def scrape() -> None:
        while time.monotonic() < stop:
            if _scrape(url):
                answers.append(time.monotonic())

    t0 = time.monotonic()
    scrapers = [threading.Thread(target=scrape) for _ in range(MAX_SCRAPERS)]
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join()
    elapsed = max(answers, default=t0) - t0
    assert answers, "no scrape was answered"
    assert len(answers) <= MAX_SCRAPES_PER_S * elapsed + 2, f"{len(answers)} answers in {elapsed:.2f} s"


def test_out_of_file_descriptors_a_metrics_connection_does_not_make_the_server_spin(
        server: ServerProcess, client: CacheClient):
    """Past the open file limit, a connection to the metrics port stays queued and its listening
    socket readable: the accept loop retried at once, for ever, at a whole core (and lookups
    slowed 18x). It now pauses after each failed accept; scrapes work again once descriptors
    are free."""
    import resource

    from kvxfer.testing.wire import RawConnection

    url = client.status().metrics_url
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)

    def cpu_s() -> float:
        fields = open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    soft, hard = resource.prlimit(server.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{server.pid}/fd")) + 2, hard))
    conns: list[RawConnection] = []
    pending = None
    try:
        conns = [RawConnection(server.url) for _ in range(6)]  # take the descriptors left
        wait_until(lambda: "out of file descriptors" in server.log(), 30, "the server out of descriptors")
        pending = socket.create_connection((host, int(port)), timeout=10)
        time.sleep(0.5)  # the accept loop has seen it
        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(2.0)
        cores = (cpu_s() - c0) / (time.monotonic() - t0)
        assert cores < 0.5, f"the server used {cores:.2f} cores while a metrics connection waited"
    finally:
        for c in conns:
            c.close()
        if pending is not None:
            pending.close()
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert "kvxfer_sessions" in wait_until(lambda: _scrape(url), 30, "a scrape with descriptors free")


def _scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode()
    except OSError:
        return ""


# --------------------------------------------------------------------------- names on terminals


BAD_NAMES = ["evil\x1b]0;owned\x07\x1b[2J", "two\nlines", "tab\there", "bidi\u202eeman", "del\x7f", "c1\x9b31m",
             "zero\u200bwidth", "nul\x00byte", "line\u2028sep"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n)[1:12])
def test_names_with_control_or_format_characters_are_refused(server: ServerProcess, ref: Writer, name: str):
    """A model name with terminal escapes once went into `kvxfer status` (and the log) as is: a
    client could clear the operator's screen, retitle the window or forge lines. Names must now
    be printable text, in a registration, a lookup, a clear and a handshake's client name."""
    peer = RawPeer(server.url)
    try:
        assert peer.error(b"register", registration(ref, 7001, model_name=name))[0] == "invalid_request"
        for req, payload in ((b"lookup", m.Lookup(name, 1, [os.urandom(16)])), (b"clear", m.Clear(name))):
            code, message = peer.error(req, codec.encode(payload))
            assert code == "invalid_request" and "model_name" in message and "U+" in message
        rid = peer.send(b"handshake", codec.encode({"protocol_version": m.PROTOCOL_VERSION, "client_name": name}))
        status, reply = peer.recv(rid)
        assert status != codec.OK and codec.ERROR_DECODER.decode(reply).code == "invalid_request"
    finally:
        peer.close()


def test_kvxfer_top_and_status_print_names_as_text(server: ServerProcess, ref: Writer):
    """A printable model name that is rich markup (``[/]``) made `kvxfer top` crash, and one
    with ``[link=...]`` was obeyed: names are shown as plain text, exactly as registered."""
    name = "[/]x[link=file:///etc/passwd]y[/link] [bold]日本語 é"
    peer = RawPeer(server.url)
    try:
        assert peer.error(b"register", registration(ref, 7002, model_name=name)) is None
        top = kvxfer_cli("top", "--url", server.url, "--once")
        status = kvxfer_cli("status", "--url", server.url)
    finally:
        peer.close()
    assert top.returncode == 0, top.stderr[-2000:]
    assert status.returncode == 0, status.stderr[-2000:]
    assert name in status.stdout
    assert "[/]x[link=file:///etc/passwd]y" in top.stdout


# --------------------------------------------------------------------------- what the server remembers


def test_model_names_do_not_grow_the_server(server: ServerProcess, client: CacheClient, ref: Writer):
    """The figures kept a label for every model name ever registered, past the
    --metrics-max-models that get their own: registering ever new names grew the server for good
    (here 2,000 names of 64 KiB, 125 MiB). Only the labelled names are remembered now."""
    peer = RawPeer(server.url)
    try:
        for j in range(40):  # warm up: the server's buffers for 64 KiB requests
            assert peer.error(b"register", registration(ref, 8000 + j, model_name=f"w{j:05d}" + "w" * 60000)) is None
            assert peer.error(b"unregister", codec.encode(m.Unregister(8000 + j))) is None
        rss0 = proc_kib(server.pid, "VmRSS")
        for j in range(2000):
            assert peer.error(b"register", registration(ref, 9000 + j, model_name=f"{j:05d}" + "n" * 65000)) is None
            assert peer.error(b"unregister", codec.encode(m.Unregister(9000 + j))) is None
        grown = (proc_kib(server.pid, "VmRSS") - rss0) / 1024
    finally:
        peer.close()
    assert grown < 40, f"the server grew by {grown:.0f} MiB for 2,000 model names it no longer serves"
    assert len(client.status().models) <= 3  # two labels of their own and __other__


def test_wide_lookups_do_not_grow_the_l2_key_cache(server: ServerProcess):
    """The L2 tier remembers the keys of recently looked-up chunks, and forgot them after 65,536
    chunks: a chunk of world_size 65,536 has that many keys, so lookups of 4 new chunks of that
    world size each left 262,144 keys behind (about 64 MiB). It counts keys now."""
    peer = RawPeer(server.url)
    try:
        def lookup() -> None:
            assert peer.error(b"lookup", codec.encode(m.Lookup("wide", 65536, [os.urandom(16) for _ in range(4)])),
                              timeout=120) is None
        for _ in range(2):
            lookup()
        rss0 = proc_kib(server.pid, "VmRSS")
        for _ in range(10):
            lookup()
        grown = (proc_kib(server.pid, "VmRSS") - rss0) / 1024
    finally:
        peer.close()
    assert grown < 200, f"the server grew by {grown:.0f} MiB for lookups it answered"


def test_a_wide_lookup_asks_the_l2_tier_about_a_bounded_number_of_keys(server: ServerProcess, client: CacheClient):
    """A lookup of 32 chunks at world size 8,192 (262,144 keys, in a request of a few hundred
    bytes) had the loop build and check every key, and look up the chunk format of each of the
    8,192 ranks among all contexts: about 1.6 s of the loop with 60 contexts. The tier now asks
    about at most L2_LOOKUP_KEYS keys per lookup (the chunks past them count as misses)."""
    from kvxfer.server.tier import L2_LOOKUP_KEYS

    before = client.status().tiers[0].lookup_chunks
    peer = RawPeer(server.url)
    try:
        assert peer.error(b"lookup", codec.encode(m.Lookup("wide", 8192, [os.urandom(16) for _ in range(32)])),
                          timeout=120) is None
    finally:
        peer.close()
    asked = client.status().tiers[0].lookup_chunks - before
    assert 0 < asked <= L2_LOOKUP_KEYS, asked


def test_requests_queued_for_a_busy_loop_are_bounded_per_connection(server: ServerProcess, client: CacheClient):
    """ZeroMQ queued up to 1,000 requests per connection while the server's loop was busy: 40
    requests of 16 MiB, each keeping the loop busy for a while (a wide lookup, padded), all
    landed in the server's memory at once (640 MiB). The server now reads a connection only
    when none of its requests waits (kvxfer.mq.listener), so it holds about one of them and the
    sender waits for the rest."""
    peer = RawPeer(server.url)
    try:
        peer.handshake()
        pad = b"\0" * ((16 << 20) - (64 << 10))
        frame = codec.encode({"model_name": "wide", "world_size": 4096,
                              "hashes": [os.urandom(16) for _ in range(64)], "pad": pad})
        del pad
        peak0 = proc_kib(server.pid, "VmHWM")
        rids = {peer.send(b"lookup", frame) for _ in range(40)}
        del frame
        while rids:  # (lookups that ask L2 may be answered out of order)
            frames = peer.conn.recv(300.0)
            assert frames is not None, f"no reply to {len(rids)} lookups"
            rid, status, reply = frames
            assert status == codec.OK, codec.ERROR_DECODER.decode(reply)
            rids.discard(codec.unpack_id(rid))
        grown = (proc_kib(server.pid, "VmHWM") - peak0) / 1024
    finally:
        peer.close()
    assert grown < 320, f"the server's peak memory grew by {grown:.0f} MiB for 40 requests of 16 MiB"


# --------------------------------------------------------------------------- the L2 header


def test_a_page_too_long_for_the_l2_header_is_refused(server: ServerProcess, client: CacheClient, ref: Writer):
    """A registration whose page named 60 extra dimensions of size 1 (a legal layout) has a chunk
    format longer than an L2 header holds: each write of its chunks failed, the failures opened
    the tier's circuit breaker, and every client's L2 writes were dropped. It is refused now."""
    reg = ref.ctx.registration()
    outer, inner = reg.page.split("|")
    page = ",".join(["X1"] * 60 + [outer]) + "|" + inner
    peer = RawPeer(server.url)
    try:
        code, message = peer.error(b"register", registration(ref, 7003, model_name="long-page", page=page))
    finally:
        peer.close()
    assert code == "invalid_request" and "page" in message, message
    tier = client.status().tiers[0]
    assert tier.outages == 0 and tier.state == "up"
