"""The L2 tier of a real server, on the ``fs`` backend (the Valkey backend's own tests, in
plugins/valkey, add two servers, clusters and faults): the value format, the write path, lookups
that span tiers, promotion, admission, backpressure, configuration and what status shows."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from kvxfer import CacheClient, TransferContext
from kvxfer.arena import Arena
from kvxfer.errors import ConfigError, KvxferError, StoreUnavailable
from kvxfer.server.index import ChunkIndex, ChunkKey, Usage
from kvxfer.server.tier import Breaker, L2Tier, TierConfig, parse_admission
from kvxfer.store import GetStatus
from kvxfer.store.format import (
    FORMAT_VERSION,
    ChunkL2Keys,
    HEADER_SIZE,
    DamagedValue,
    IntegrityError,
    decode_header,
    encode_header,
    l2_key,
)
from kvxfer.testing.server import ServerProcess
from kvxfer_core_helpers import BLOCK_SIZE, BLOCKS_PER_CHUNK, CHUNK_SIZE, flash_attn_kv, wait_until

pytestmark = pytest.mark.slow

FMT = "bfloat16:2x2x64x16"
#: A registered layout whose chunks have 4096 bytes.
FMT_4K = "bfloat16:2x2x32x16"
TIMEOUT = 30


# --------------------------------------------------------------------------- the value format


def test_header_round_trip_and_every_mismatch_is_an_integrity_error() -> None:
    """Every mismatch is an IntegrityError; only those that no reader of the key could load, in
    any layout, are DamagedValue (the tier deletes those): an intact header of another chunk
    format is not. Another format version under a key of this one is damage (keys carry the
    version: another version never writes under them)."""
    key = ChunkKey("m", 2, 1, b"h" * 16)
    payload = bytes(range(256)) * 32  # 8 KiB: 2 layers x 2 planes x 64 tokens x 16 x bf16
    raw = encode_header(key, FMT, payload)
    assert len(raw) == HEADER_SIZE
    h = decode_header(raw, key, FMT)
    assert (h.length, h.fmt) == (len(payload), FMT)
    with pytest.raises(DamagedValue, match="another chunk"):
        decode_header(raw, ChunkKey("m", 2, 0, b"h" * 16), None)  # another rank
    damaged = bytearray(raw)
    damaged[20] ^= 1
    with pytest.raises(DamagedValue, match="damaged header"):
        decode_header(bytes(damaged), key, FMT)
    with pytest.raises(DamagedValue, match="bad magic"):
        decode_header(b"X" + raw[1:], key, FMT)
    with pytest.raises(IntegrityError, match="reader's layout") as other_layout:
        decode_header(raw, key, "float16:2x2x64x16")
    assert not isinstance(other_layout.value, DamagedValue), "an intact value of another layout may be another server's"
    next_version = bytearray(raw)  # a later format may lay its header out differently
    next_version[4:6] = (2).to_bytes(2, "little")
    next_version[20:40] = bytes(20)
    with pytest.raises(DamagedValue, match="format version 2"):
        decode_header(bytes(next_version), key, FMT)
    assert l2_key(key).startswith(b"kvxfer:c%d:" % FORMAT_VERSION)


@pytest.mark.parametrize("reader_fmt", [FMT, "float16:2x2x64x16", None])
@pytest.mark.parametrize("fmt, length", [(FMT, 1 << 60), (FMT, 8191), ("float16:2x2x64x8", 8192),
                                         ("no_such_dtype:2x2x64x16", 8192)])
def test_a_header_that_contradicts_itself_is_damaged_for_every_reader(reader_fmt: str | None, fmt: str,
                                                                        length: int) -> None:
    """An intact header (its check recomputed) whose length is not its own format's size can be
    loaded by no reader in any layout: damaged (deleted), not taken for another layout's value
    and left in the store for ever. A format this version cannot read (a later kvxfer's dtype)
    is not damage: that value may be a newer server's, and is left alone."""
    import struct

    import xxhash

    from kvxfer.store.format import MAGIC, checksum, fingerprint

    key = ChunkKey("m", 2, 1, b"h" * 16)
    body = struct.pack("<4sHHQ16s16s128s8s", MAGIC, FORMAT_VERSION, HEADER_SIZE, length, checksum(b""),
                       fingerprint(key, fmt), fmt.encode(), bytes(8))
    with pytest.raises(IntegrityError) as raised:
        decode_header(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)), key, reader_fmt)
    assert isinstance(raised.value, DamagedValue) == (not fmt.startswith("no_such_dtype")), raised.value


def test_header_takes_every_registered_layouts_format() -> None:
    from kvxfer.layout import KVLayout, LayoutKind
    from kvxfer.store.format import chunk_format_bytes

    key = ChunkKey("m", 1, 0, b"h" * 16)
    for kind, hidden in ((LayoutKind.FLASH_ATTN, 1024), (LayoutKind.FLASHINFER, 1024), (LayoutKind.MLA, 576)):
        lay = KVLayout(kind, 4, 64, 16, hidden, torch.bfloat16)
        fmt = lay.chunk_format(256)
        assert chunk_format_bytes(fmt) == lay.chunk_bytes(256), fmt
        assert decode_header(encode_header(key, fmt, bytes(lay.chunk_bytes(256))), key, fmt).fmt == fmt


def test_l2_keys_follow_every_field_of_the_chunk_key() -> None:
    base = ChunkKey("m", 2, 1, b"h" * 16)
    variants = [ChunkKey("n", 2, 1, b"h" * 16), ChunkKey("m", 4, 1, b"h" * 16), ChunkKey("m", 2, 0, b"h" * 16),
                ChunkKey("m", 2, 1, b"i" * 16)]
    keys = {l2_key(k) for k in [base, *variants]}
    assert len(keys) == 5 and all(k.startswith(b"kvxfer:") for k in keys)
    assert l2_key(base) == l2_key(ChunkKey("m", 2, 1, b"h" * 16))


@pytest.mark.parametrize("model", ["m", "x" * 300, "modèle/ünï"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_the_l2_keys_a_lookup_derives_are_those_of_l2_key(model: str, world_size: int) -> None:
    """Lookups derive every rank's L2 key from hashers primed with the fields before the chunk
    hash (ChunkL2Keys): the keys must be exactly l2_key's (values stored under those are found),
    for any model name and hash length (MessagePack's encoding of each changes with its length)."""
    make = ChunkL2Keys([ChunkKey(model, world_size, r, b"") for r in range(world_size)])
    for n in (0, 1, 16, 32, 255, 256, 70_000):
        h = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
        assert make(h) == tuple(l2_key(ChunkKey(model, world_size, r, h)) for r in range(world_size)), n
    with pytest.raises(ValueError, match="empty chunk hash"):
        ChunkL2Keys([ChunkKey(model, world_size, 0, b"h")])


# --------------------------------------------------------------------------- configuration


def test_admission_and_config_are_validated_with_a_way_out() -> None:
    assert parse_admission("all") == 0 and parse_admission("hits:3") == 3
    # int() takes blanks, signs and non-ASCII digits: none of them is what N means here
    for bad in ("some", "hits:0", "hits:x", "hits: 3", "hits:+3", "hits:\u0663", "hits:99999999999999999999"):
        with pytest.raises(ConfigError, match="'all'.*'hits:N'"):
            parse_admission(bad)
    with pytest.raises(ConfigError, match="needs --l2-url"):
        TierConfig(store="fs", url="")
    with pytest.raises(ConfigError, match="--l2-timeout"):
        TierConfig(store="fs", url="/x", timeout_s=0)


def test_breaker_opens_after_consecutive_failures_and_backs_off() -> None:
    b = Breaker(threshold=2, backoff=0.01, max_backoff=0.04)
    assert not b.failure("e1") and b.closed
    b.success()
    assert not b.failure("e1") and b.failure("e2") and not b.closed
    time.sleep(0.02)
    assert b.probe_due()
    b.probed(False, "still down")
    assert not b.probe_due() and b.delay == 0.02 and b.last_error == "still down"
    b.probed(False)
    b.probed(False)
    assert b.delay == 0.04  # capped
    b.probed(True)
    assert b.closed and b.opened == 1


def test_a_store_that_passes_probes_but_fails_the_work_keeps_the_breaker_backing_off() -> None:
    """A store that answers the health thread's ping but not lookups or gets (a node hung on
    them, or one that refuses them) must not cost ``threshold`` failed operations every base
    delay: reopened before any operation succeeded, the breaker waits twice as long as before;
    once an operation succeeds in between, it starts over from the base delay."""
    b = Breaker(threshold=2, backoff=0.01, max_backoff=0.04)
    b.failure("timeout")
    assert b.failure("timeout") and b.delay == 0.01
    for delay in (0.02, 0.04, 0.04):  # the ping passes, the work fails again: capped doubling
        b.probed(True)
        b.failure("timeout")
        assert b.failure("timeout") and b.delay == delay
    b.probed(True)
    b.success()  # an operation worked: the store is back
    b.failure("timeout")
    assert b.failure("timeout") and b.delay == 0.01


def test_plugins_lists_store_backends(capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.cli import main

    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["store_entry_point_group"] == "kvxfer.stores" and report["store_api_version"] == 1
    fs = {p["name"]: p for p in report["stores"]}["fs"]
    assert (fs["health"], fs["distribution"], fs["api_version"]) == ("available", "kvxfer", 1)
    assert main(["plugins"]) == 0
    table = capsys.readouterr().out
    assert "store backends (L2)" in table and "fs: local directory store" in table


def test_serve_refuses_unknown_store_and_url_without_store(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.cli import main

    assert main(["serve", "--url", f"ipc://{tmp_path}/s.sock", "--l2", "nosuch", "--l2-url", "x://y"]) == 2
    err = capsys.readouterr().err
    assert "no store named 'nosuch'" in err and "installed: fs (kvxfer), valkey (kvxfer-valkey)" in err
    assert "kvxfer-nosuch" not in err, err  # no distribution of that name exists
    assert main(["serve", "--url", f"ipc://{tmp_path}/s.sock", "--l2-url", "file:///tmp/x"]) == 2
    assert "--l2-url needs --l2 NAME" in capsys.readouterr().err
    # any option of the tier without one would be ignored without a word: refused, each named
    assert main(["serve", "--url", f"ipc://{tmp_path}/s.sock", "--l2-admission", "hits", "--l2-queue", "8"]) == 2
    assert "--l2-admission, --l2-queue need --l2 NAME" in capsys.readouterr().err
    assert not (tmp_path / "s.sock").exists()


def test_the_password_from_the_environment_goes_to_network_hosts_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$KVXFER_L2_PASSWORD`` is the password of a store URL's hosts: the first URL's (after a
    user info that holds commas too), or a later URL's; never a local path's, whose errors would
    then quote it."""
    from kvxfer.cli import L2_PASSWORD_ENV, _l2_config, build_parser

    monkeypatch.setenv(L2_PASSWORD_ENV, "S3cretPW")

    def url_of(*args: str) -> str:
        config = _l2_config(build_parser().parse_args(["serve", *args]))
        assert config is not None
        return config.url

    for local in ("file://localhost/srv/l2", "file:///srv/l2", "/srv/l2"):
        assert url_of("--l2", "fs", "--l2-url", local) == local
    assert url_of("--l2", "valkey", "--l2-url", "valkey://kv@h1:1,h2:2") == "valkey://kv:S3cretPW@h1:1,h2:2"
    assert url_of("--l2", "valkey", "--l2-url", "valkey://h1:1,valkey://kv@h2:2") == \
        "valkey://:S3cretPW@h1:1,valkey://kv:S3cretPW@h2:2"
    given = "valkey://kv:a,b@h1:1"  # a password of its own, commas and all, is kept
    assert url_of("--l2", "valkey", "--l2-url", given) == given
    monkeypatch.setenv(L2_PASSWORD_ENV, os.fsdecode(b"\xff\xfe"))  # bytes that are no UTF-8: a traceback before
    with pytest.raises(ConfigError, match=r"\$KVXFER_L2_PASSWORD is not UTF-8 text"):
        url_of("--l2", "valkey", "--l2-url", "valkey://h1:1")


@pytest.mark.parametrize("store, url, says", [
    ("fs", "file:///no-such-mount/kvxfer/kv", "/no-such-mount/kvxfer does not exist"),
    ("valkey", "valkey://127.0.0.1:1?protocol=3", "unknown option(s) 'protocol'"),
])
def test_an_l2_url_the_store_cannot_use_stops_the_server_before_it_makes_its_arena(
        tmp_path: Path, store: str, url: str, says: str) -> None:
    """The store is opened before the arena is made (seconds per GiB on some hosts: a user waited
    minutes of a 64 GiB arena to learn of a typo in --l2-url)."""
    if store == "valkey":
        pytest.importorskip("kvxfer_valkey")
    r = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--l1-size", "1GiB", "--url",
                        f"ipc://{tmp_path}/run/kvxfer.sock", "--l2", store, "--l2-url", url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]
    assert "making the L1 arena" not in r.stderr, "the arena was made before the URL was tried"


@pytest.mark.parametrize("fails", ["transports", "worker pool"])
def test_a_server_that_fails_to_start_closes_the_store_it_opened_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """The L2 store is opened before the arena; a server whose start fails after that closes it
    (the fs store's directory lock released: a second server takes the directory) and removes
    its arena. ``worker pool``: a thread pool that cannot start, injected here (nothing on this
    machine makes one fail); ``transports``: a real failure, a transport that is not installed."""
    from kvxfer.server import CacheServer, ServerConfig

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    l2 = TierConfig("fs", f"file://{tmp_path}/l2")

    def config(transports: tuple[str, ...]) -> ServerConfig:
        return ServerConfig(url=f"ipc://{tmp_path}/run/kvxfer.sock", l1_size=8 << 20, shm_dir=str(shm),
                            transports=transports, l2=l2)

    if fails == "worker pool":
        import kvxfer.server.engine as engine

        def no_pool(*args: object, **kwargs: object) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(engine, "WorkerPool", no_pool)
    with pytest.raises((KvxferError, RuntimeError)):
        CacheServer(config(("no_such_transport",) if fails == "transports" else ("cpu_gather",)))
    monkeypatch.undo()
    assert not [p for p in shm.iterdir() if not p.name.startswith(".")], "the arena was left"
    with ServerProcess(l1_size="8MiB", extra_args=["--l2", "fs", "--l2-url", l2.url]) as srv:  # the directory is free
        assert "another kvxfer server uses the fs store" not in srv.log()


def test_an_unknown_store_is_answered_with_distributions_that_exist() -> None:
    """A group where a published backend is not installed suggests its real distribution, and
    only that one: never a package name made up from the unknown name."""
    from kvxfer.errors import StoreBroken, StoreNotFound
    from kvxfer.store.base import STORE_API_VERSION, Store
    from kvxfer.store.registry import DISTRIBUTIONS
    from kvxfer.transport.registry import EntryPointGroup

    group = EntryPointGroup("kvxfer.no-such-group", "store", Store, STORE_API_VERSION,
                            "kvxfer.store.STORE_API_VERSION", StoreNotFound, StoreBroken, DISTRIBUTIONS)
    with pytest.raises(StoreNotFound) as info:
        group.load("redis")
    msg = str(info.value)
    assert "installed: none" in msg and "valkey (kvxfer-valkey: pip install plugins/valkey)" in msg, msg
    assert "from a kvxfer checkout" in msg and "kvxfer-redis" not in msg, msg
    with pytest.raises(StoreNotFound, match="'valkey' comes with the distribution kvxfer-valkey: pip install "
                                            "plugins/valkey in a kvxfer checkout"):
        group.load("valkey")


# --------------------------------------------------------------------------- a server with an fs tier

#: 256 KiB chunks (2 layers x 2 planes x 64 tokens x 4 heads x 128 x bf16): the 4 MiB arena holds 16.
HEADS, HEAD = 4, 128


def big_kv(seed: int, num_blocks: int = 112) -> list[torch.Tensor]:
    return flash_attn_kv(num_layers=2, num_blocks=num_blocks, heads=HEADS, head_size=HEAD, seed=seed)


def rows(kv: list[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [layer[:, blocks].clone() for layer in kv]


def blocks_of(first_chunk: int, n: int) -> list[int]:
    return list(range(first_chunk * BLOCKS_PER_CHUNK, (first_chunk + n) * BLOCKS_PER_CHUNK))


def settled(client: CacheClient, writes: int) -> object:
    return wait_until(lambda: (t := client.status().tiers[0]).writes + t.write_skipped >= writes
                      and t.queue_depth == 0, TIMEOUT, 0.02)


def in_l2_and_again_in_l1(c: CacheClient, ctx: TransferContext, model: str, keys: list[bytes], again: slice) -> None:
    """``keys`` stored (blocks in order) and written to L2, cleared from L1, then ``keys[again]``
    stored again (L1 holds those, L2 all)."""
    ctx.submit_store(keys, blocks_of(0, len(keys))).result(TIMEOUT)
    assert settled(c, c.status().tiers[0].writes)
    assert c.clear(model) == len(keys)
    ctx.submit_store(keys[again], blocks_of(again.start, again.stop - again.start)).result(TIMEOUT)


@pytest.fixture(scope="module")
def fs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    l2 = tmp_path_factory.mktemp("l2") / "store"
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{l2}"]) as srv:
        yield srv


def test_evicted_chunks_come_back_from_l2_byte_for_byte(fs_server: ServerProcess) -> None:
    kv = big_kv(1)
    with CacheClient(fs_server.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="evict", block_size=BLOCK_SIZE, transport="cpu_gather")
        keys = [bytes([i]) * 16 for i in range(24)]
        for first in (0, 8, 16):  # 24 chunks through an arena of 16
            assert not ctx.submit_store(keys[first:first + 8], blocks_of(first, 8)).result(TIMEOUT).failed
            assert settled(c, first + 8)
        st = c.status()
        assert st.arena.evictions >= 8 and st.tiers[0].writes == 24
        assert c.lookup("evict", hashes=keys) == 24  # L1 and then L2
        reply = c.lookup_and_lease("evict", hashes=keys[:6], lease_s=30)
        assert (reply.hits, reply.l2_hits) == (6, 6)
        want = rows(kv, blocks_of(0, 6))
        res = ctx.submit_retrieve(keys[:6], blocks_of(16, 6), lease_id=reply.lease_id).result(TIMEOUT)
        assert res.loaded == list(range(6))
        got = rows(kv, blocks_of(16, 6))
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got))
        ctx.close()


def test_lookup_without_promotion_counts_l2_and_leases_only_l1(fs_server: ServerProcess) -> None:
    kv = big_kv(2)
    with CacheClient(fs_server.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="nopromo", block_size=BLOCK_SIZE, transport="cpu_gather")
        keys = [b"n" + bytes([i]) * 15 for i in range(4)]
        in_l2_and_again_in_l1(c, ctx, "nopromo", keys, slice(0, 2))  # 2 back in L1, 4 in L2
        reply = c.lookup_and_lease("nopromo", hashes=keys, lease_s=30, promote=False)
        assert (reply.hits, reply.l2_hits) == (4, 2)
        res = ctx.submit_retrieve(keys, blocks_of(8, 4), lease_id=reply.lease_id).result(TIMEOUT)
        assert (res.loaded, res.missing) == ([0, 1], [2, 3])
        assert c.lookup("nopromo", hashes=[b"z" * 16]) == 0
        ctx.close()


def test_the_tiers_hit_rate_counts_every_key_it_had(fs_server: ServerProcess) -> None:
    """A lookup asks the tier about every chunk after L1's leading hits, including chunks L1 has
    further on: the tier's hits count every one of them it had (they counted only those L1
    lacked, so a tier that had all it was asked read as a 50% hit rate)."""
    kv = big_kv(5)
    with CacheClient(fs_server.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="tierrate", block_size=BLOCK_SIZE, transport="cpu_gather")
        keys = [b"t" + bytes([i]) * 15 for i in range(4)]
        in_l2_and_again_in_l1(c, ctx, "tierrate", keys, slice(2, 4))  # L1: the last 2; L2: all 4
        before = c.status().tiers[0]
        assert c.lookup("tierrate", hashes=keys) == 4
        after = c.status().tiers[0]
        assert (after.lookup_chunks - before.lookup_chunks, after.lookup_hits - before.lookup_hits) == (4, 4)
        assert c.lookup("tierrate", hashes=[b"u" * 16]) == 0  # asked, not had
        last = c.status().tiers[0]
        assert (last.lookup_chunks - after.lookup_chunks, last.lookup_hits - after.lookup_hits) == (1, 0)
        ctx.close()


def test_status_tells_the_hits_of_each_tier(fs_server: ServerProcess) -> None:
    """A lookup whose first 2 chunks are in L1 and next 2 in L2: the server's hits count 4, of
    which 2 in L2, per model and in all; ``kvxfer status`` prints L1's and L2's hit rates (its
    one rate counted both, so L1's could not be told)."""
    import subprocess
    import sys

    kv = big_kv(6)
    with CacheClient(fs_server.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="tierhits", block_size=BLOCK_SIZE, transport="cpu_gather")
        keys = [b"q" + bytes([i]) * 15 for i in range(4)]
        in_l2_and_again_in_l1(c, ctx, "tierhits", keys, slice(0, 2))  # L1: the first 2; L2: all 4
        before = c.status()
        reply = c.lookup_and_lease("tierhits", hashes=keys + [b"none" * 4], lease_s=5, promote=False)
        assert (reply.hits, reply.l2_hits) == (4, 2)
        c.release_lease(reply.lease_id)
        st = c.status()
        assert (st.lookup_hits - before.lookup_hits, st.lookup_l2_hits - before.lookup_l2_hits) == (4, 2)
        (model,) = [x for x in st.models if x.model == "tierhits"]
        assert (model.lookup_chunks, model.lookup_hits, model.lookup_l2_hits) == (5, 4, 2)
        ctx.close()
        out = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--url", fs_server.url], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        st = c.status()
        l1, l2 = ((st.lookup_hits - st.lookup_l2_hits) / st.lookup_chunks, st.lookup_l2_hits / st.lookup_chunks)
        assert f": L1 {100 * l1:.1f}%, L2 {100 * l2:.1f}%)" in out.stdout, out.stdout


def test_a_promoting_lookup_keeps_its_l1_hits_and_its_promoted_chunks_under_their_lease(tmp_path: Path) -> None:
    """A lookup whose first chunks are in L1 and whose next ones come from L2 makes room for the
    promotion without evicting its own L1 hits (it once evicted them, then failed with an
    internal KeyError while leasing them); once promoted, the leased chunks stay pinned, so an
    arena filled by other stores meanwhile evicts none of them before the load."""
    kv = big_kv(7)
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{tmp_path}/store"]) as srv, \
            CacheClient(srv.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="own-hits", block_size=BLOCK_SIZE, transport="cpu_gather")
        x = [b"X" + bytes([i]) * 15 for i in range(8)]
        p = [b"P" + bytes([i]) * 15 for i in range(2)]
        fill = [b"F" + bytes([i]) * 15 for i in range(30)]
        want = [torch.cat([a, b], dim=1) for a, b in zip(rows(kv, blocks_of(8, 2)), rows(kv, blocks_of(0, 8)))]
        written = 0
        for keys, first in ((x, 0), (p, 8), (fill[:6], 10), (fill[6:14], 10)):  # the arena holds 16: X leaves it
            assert not ctx.submit_store(keys, blocks_of(first, len(keys))).result(TIMEOUT).failed
            written += len(keys)
            assert settled(c, written), c.status().tiers[0]
        assert c.lookup("own-hits", hashes=p, promote=False) == 2  # P: first in line to be evicted
        reply = c.lookup_and_lease("own-hits", hashes=p + x, lease_s=30)
        assert (reply.hits, reply.l2_hits) == (10, 8)
        assert wait_until(lambda: c.status().tiers[0].promoting == 0, TIMEOUT, 0.02)
        # other stores fill the arena: only the 6 unleased chunks may make room
        stored = ctx.submit_store(fill[14:30], blocks_of(10, 16)).result(TIMEOUT)
        assert len(stored.stored) == 6, stored
        res = ctx.submit_retrieve(p + x, blocks_of(12, 10), lease_id=reply.lease_id).result(TIMEOUT)
        assert (res.loaded, res.missing) == (list(range(10)), [])
        got = rows(kv, blocks_of(12, 10))
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got))
        assert "Traceback" not in srv.log() and "KeyError" not in srv.log()
        ctx.close()


def test_a_lookup_refused_for_its_lease_promotes_nothing(tmp_path: Path) -> None:
    """A lookup whose lease would pass the session's limits is refused before it promotes: the
    arena and the store are left as they were (it once promoted its L2 hits, evicting others'
    chunks, and then was refused)."""
    from kvxfer.errors import LimitExceeded

    kv = big_kv(9)
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{tmp_path}/store",
                                   "--max-leases-per-session", "1"]) as srv, \
            CacheClient(srv.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="refused", block_size=BLOCK_SIZE, transport="cpu_gather")
        keys = [b"R" + bytes([i]) * 15 for i in range(6)]
        assert not ctx.submit_store(keys, blocks_of(0, 6)).result(TIMEOUT).failed
        assert settled(c, 6)
        assert c.clear("refused") == 6
        first = c.lookup_and_lease("refused", hashes=keys[:2], lease_s=30)  # the one lease allowed
        assert (first.hits, first.l2_hits) == (2, 2) and first.lease_id
        assert wait_until(lambda: c.status().tiers[0].promoting == 0, TIMEOUT, 0.02)
        before = c.status()
        with pytest.raises(LimitExceeded, match="max_leases_per_session"):
            c.lookup_and_lease("refused", hashes=keys[2:], lease_s=30)
        after = c.status()
        assert after.tiers[0].promotions == before.tiers[0].promotions == 2
        assert after.arena.chunks == before.arena.chunks == 2
        assert c.lookup("refused", hashes=keys[2:], promote=True) == 4  # without a lease: promoted
        ctx.close()


def test_a_read_releases_its_lease_on_the_chunks_whose_promotion_failed(tmp_path: Path) -> None:
    """A promoting lookup leases its L2 hits; one whose value turns out damaged is dropped from
    the arena, and the read that names the lease reports it missing. Its lease kept it counted
    until it expired (300 s here): the session's pins stayed at the limit, and a lookup of chunks
    in L1 was refused. The read releases the lease on the chunks it reports missing too."""
    kv = big_kv(10)
    with ServerProcess(l1_size="4MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{tmp_path}/store",
                                   "--max-chunk-pins-per-session", "4"]) as srv, \
            CacheClient(srv.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="damaged", block_size=BLOCK_SIZE, transport="cpu_gather")
        keys = [b"D" + bytes([i]) * 15 for i in range(4)]
        assert not ctx.submit_store(keys, blocks_of(0, 4)).result(TIMEOUT).failed
        assert settled(c, 4)
        assert c.clear("damaged") == 4
        values = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.stat().st_size > HEADER_SIZE]
        assert len(values) == 4
        for path in values:  # a bit flipped in each: found by the lookup, refused at its checksum
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
        reply = c.lookup_and_lease("damaged", hashes=keys, lease_s=300)
        assert (reply.hits, reply.l2_hits) == (4, 4)
        res = ctx.submit_retrieve(keys, blocks_of(4, 4), lease_id=reply.lease_id).result(TIMEOUT)
        assert res.missing == [0, 1, 2, 3]
        st = c.status()
        assert (st.leases, st.leased_chunks, st.arena.chunks) == (0, 0, 0)
        fresh = [b"F" + bytes([i]) * 15 for i in range(2)]
        assert not ctx.submit_store(fresh, blocks_of(0, 2)).result(TIMEOUT).failed
        assert c.lookup_and_lease("damaged", hashes=fresh, lease_s=30).hits == 2  # within the pin limit
        ctx.close()


def test_status_shows_the_tier(fs_server: ServerProcess) -> None:
    out = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--url", fs_server.url], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "l2: fs at file://" in out.stdout and ": up" in out.stdout
    for field in ("lookups:", "promotions:", "writes:", "queue 0/64", "drops", "errors:"):
        assert field in out.stdout
    with CacheClient(fs_server.url) as c:
        tier = c.status().tiers[0]
    assert (tier.store, tier.state, tier.admission) == ("fs", "up", "all")


def test_admission_after_hits_and_backpressure_drops(tmp_path: Path) -> None:
    kv = big_kv(3)
    with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{tmp_path}/a", "--l2-admission", "hits:2"]) as srv:
        with CacheClient(srv.url, timeout=TIMEOUT) as c:
            ctx = c.register(kv, model_name="adm", block_size=BLOCK_SIZE, transport="cpu_gather")
            keys = [b"a" + bytes([i]) * 15 for i in range(3)]
            ctx.submit_store(keys, blocks_of(0, 3)).result(TIMEOUT)
            ctx.submit_retrieve(keys[:1], blocks_of(4, 1)).result(TIMEOUT)  # a read is not a hit
            # the first hit of chunks 0 and 1: chunk 1, named twice, is found once (it was counted
            # twice, and admitted by one lookup)
            assert c.lookup("adm", hashes=keys[:2] + keys[1:2]) == 3
            # admission runs on the server's loop before it answers the lookup: a chunk admitted
            # now would be queued, pinned, written or dropped by the time status answers
            tier = c.status().tiers[0]
            assert (tier.writes, tier.write_skipped, tier.queue_depth, tier.pinned_bytes, tier.drops) == (0,) * 5, \
                f"hits:2 writes nothing before two lookups found it: {tier}"
            assert c.lookup("adm", hashes=keys[:1]) == 1  # the second of chunk 0
            assert settled(c, 1)
            assert c.status().tiers[0].writes == 1
            ctx.close()
    with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{tmp_path}/b", "--l2-queue", "1",
                                   "--l2-writers", "1"]) as srv:
        with CacheClient(srv.url, timeout=TIMEOUT) as c:
            ctx = c.register(kv, model_name="bp", block_size=BLOCK_SIZE, transport="cpu_gather")
            keys = [b"b" + bytes([i]) * 15 for i in range(16)]
            res = ctx.submit_store(keys, blocks_of(0, 16)).result(TIMEOUT)
            assert res.stored == list(range(16)), "a full L2 queue never fails or slows a store"
            # a batch leaves the queue on its writer's thread and is counted on the loop just after
            wait_until(lambda: (t := c.status().tiers[0]).queue_depth == 0 and t.writes + t.drops == 16,
                       TIMEOUT, 0.02)
            tier = c.status().tiers[0]
            assert tier.drops >= 1 and tier.writes + tier.drops == 16, tier
            # lookups that find the dropped chunks in L1 queue them again, as the queue has room
            # (a dropped write was lost to L2 for good: other hosts missed those chunks for ever)
            for _ in range(40):
                assert c.lookup("bp", hashes=keys) == 16
                wait_until(lambda: c.status().tiers[0].queue_depth == 0, TIMEOUT, 0.02)
                if c.status().tiers[0].writes == 16:
                    break
            again = c.status().tiers[0]
            assert again.writes == 16 and again.drops == tier.drops, (tier, again)  # not counted again
            ctx.close()


# --------------------------------------------------------------------------- a lookup that waits


@contextlib.contextmanager
def in_process_tier(tmp_path: Path, expected_format: Callable[[ChunkKey], str | None] = lambda key: FMT_4K,
                    write_yield_s: float = 0.0,
                    ) -> Iterator[tuple[Arena, ChunkIndex, L2Tier, Callable[[Callable[[], bool]], None]]]:
    """A real arena, index and L2 tier over the fs store, in this process; ``pump(until)`` plays
    the server's loop (runs what other threads handed to it) until ``until()`` holds.
    ``expected_format`` stands for the registered layouts (default: every model's, in chunks of
    4096 bytes)."""
    arena = Arena.create(1 << 20, tmp_path)
    index = ChunkIndex(arena.size)
    calls: list[Callable[[], None]] = []
    tier = L2Tier(TierConfig("fs", f"file://{tmp_path}/l2", write_yield_s=write_yield_s), index, arena, calls.append,
                  expected_format)
    tier.start()

    def pump(until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not until():
            assert time.monotonic() < deadline
            while calls:
                calls.pop(0)()
            time.sleep(0.005)

    try:
        yield arena, index, tier, pump
    finally:
        tier.close()
        arena.close()


def offer(index: ChunkIndex, tier: L2Tier, keys: list[ChunkKey], size: int) -> None:
    """Store ``keys`` in L1 (chunks of ``size`` bytes) and offer them to the tier."""
    res, _, _ = index.reserve_write(keys, FMT, size, 1, Usage())
    tier.offer([e for _, e in index.commit_write(res)])


def only_in_l2(index: ChunkIndex, tier: L2Tier, pump: Callable[[Callable[[], bool]], None],
               hashes: list[bytes], size: int) -> None:
    """Chunks ``hashes`` of model "m" written to L2 and dropped from L1."""
    offer(index, tier, [ChunkKey("m", 1, 0, h) for h in hashes], size)
    pump(lambda: tier.writes == len(hashes))
    assert len(index.clear()) == len(hashes)


def test_a_lookup_reads_l1_again_when_the_index_changed_while_the_store_answered(tmp_path: Path) -> None:
    """In process, with the real fs store, arena and index: what a lookup read of L1 while its
    check was out holds only while nothing changed; a change makes it read L1 again, and hits
    that left L1 meanwhile are not counted."""
    with in_process_tier(tmp_path) as (arena, index, tier, pump):
        def store(hashes: list[bytes]) -> None:
            res, _, _ = index.reserve_write([ChunkKey("m", 1, 0, h) for h in hashes], FMT, 4096, 1, Usage())
            for _, e in res.entries:
                arena.memoryview(e.offset, e.size)[:] = e.key.chunk_hash * 256
            tier.offer([e for _, e in index.commit_write(res)])

        hashes = [bytes([i]) * 16 for i in range(4)]
        store(hashes)
        pump(lambda: tier.writes == 4)
        assert len(index.clear()) == 4
        store(hashes[:2])  # chunks 0 and 1 in L1 again; all four in L2

        def lookup(meanwhile) -> tuple[int, int, int]:
            hits = index.lookup("m", 1, hashes)
            assert hits == 2
            lk = tier.begin_lookup("m", 1, hashes, hits)
            assert lk is not None
            meanwhile()
            pump(lk.done)
            return tier.finish_lookup(lk, promote=False)

        assert lookup(lambda: None) == (4, 2, 2)  # nothing changed: the answer is only compared
        assert lookup(lambda: store([b"x" * 16])) == (4, 2, 2)  # a change elsewhere: L1 read again
        lease = index.lease(index.lease_keys("m", 1, hashes[1:2]), 30, Usage())
        assert lookup(lambda: index.clear()) == (0, 0, 0), "chunk 0 left L1 while the store answered"
        index.release_lease(lease)


def test_a_promotion_whose_get_raises_at_submit_ends_and_wakes_its_waiters(tmp_path: Path) -> None:
    """In process, with the real fs store, arena and index. A backend whose ``submit_get``
    raises something other than StoreUnavailable (the fs one never does: this test swaps in a
    failing submit_get, as a third-party backend might have) fails the promotion: it ends (a
    retrieve waiting for it, which holds its place in its instance's lane, goes on), its L1
    slots are given back, and the lookup counts no L2 hits for it."""
    with in_process_tier(tmp_path) as (_arena, index, tier, pump):
        hashes = [bytes([i]) * 16 for i in range(2)]
        keys = [ChunkKey("m", 1, 0, h) for h in hashes]
        only_in_l2(index, tier, pump, hashes, 4096)

        def refuse(items):
            raise ConnectionError("the store's client broke")

        assert tier.backend is not None
        tier.backend.submit_get = refuse  # type: ignore[method-assign]
        lk = tier.begin_lookup("m", 1, hashes, 0)
        assert lk is not None
        pump(lk.done)
        hits, _, _ = tier.finish_lookup(lk, promote=True)
        assert hits == 0
        pump(lambda: not tier.promoting)
        assert not tier.pending(keys) and index.lookup("m", 1, hashes) == 0
        assert tier.promote_failures == 2 and len(index.entries) == 0


def test_a_promotion_is_waited_for_once_however_often_a_request_names_its_chunks(tmp_path: Path) -> None:
    """In process, with the real fs store, arena and index. What a request waits for is each
    running promotion once: a read naming one promoting chunk 16,384 times registered 16,384
    callbacks, all run on the loop when the promotion ended (seconds of a stalled loop for a
    few such reads). The get is held by a future this test resolves."""
    with in_process_tier(tmp_path) as (_arena, index, tier, pump):
        hashes = [bytes([i]) * 16 for i in range(2)]
        keys = [ChunkKey("m", 1, 0, h) for h in hashes]
        only_in_l2(index, tier, pump, hashes, 4096)
        held: Future[list[GetStatus]] = Future()
        assert tier.backend is not None
        tier.backend.submit_get = lambda items: held  # type: ignore[method-assign]
        lk = tier.begin_lookup("m", 1, hashes, 0)
        assert lk is not None
        pump(lk.done)
        assert tier.finish_lookup(lk, promote=True)[0] == 2
        running = tier.pending(keys)
        assert 1 <= len(running) <= 2 and len({id(f) for f in running}) == len(running)
        assert tier.pending(keys * 8192) == running
        held.set_result([GetStatus.MISS, GetStatus.MISS])
        pump(lambda: not tier.promoting)
        assert not tier.pending(keys)


def test_a_promotion_waiting_on_the_store_holds_up_no_write(tmp_path: Path) -> None:
    """In process, with the real fs store, arena and index. The writers yield (up to
    ``write_yield_s``) to arena slots being filled, for the client copies they would slow; a
    promotion's get counted too, so while one waited on a slow store every write batch waited
    its whole yield (40 chunks a second at the defaults, the rest dropped), and for as long as
    a stuck get lasted. The get is held by a future this test resolves; the yield is 60 s."""
    with in_process_tier(tmp_path, write_yield_s=60.0) as (_arena, index, tier, pump):
        hashes = [bytes([i]) * 16 for i in range(2)]
        assert tier.backend is not None
        real_get = tier.backend.submit_get
        held: Future[list[GetStatus]] = Future()
        tier.backend.submit_get = lambda items: held  # type: ignore[method-assign]
        only_in_l2(index, tier, pump, hashes, 4096)
        lk = tier.begin_lookup("m", 1, hashes, 0)
        assert lk is not None
        pump(lk.done)
        assert tier.finish_lookup(lk, promote=True)[0] == 2 and tier.promoting
        fresh = [ChunkKey("m", 1, 0, bytes([9 + i]) * 16) for i in range(4)]
        offer(index, tier, fresh, 4096)
        pump(lambda: tier.writes == 6)  # written while the get still waits
        assert tier.promoting
        tier.backend.submit_get = real_get  # type: ignore[method-assign]
        held.set_result([GetStatus.MISS, GetStatus.MISS])
        pump(lambda: not tier.promoting)


def test_a_promotion_deletes_a_damaged_value_and_leaves_another_layouts(tmp_path: Path) -> None:
    """In process, with the real fs store, arena and index. Each way a value can be damaged (a
    bit flipped; a header of another format version under this version's key) is a miss, and the
    promotion that found it deletes it: the next lookup finds no L2 hit there, and the chunk
    stored again is written (not skipped as already stored) and loads byte for byte. A value
    whose size changed since the lookup (its file shortened behind the store's back here; as
    likely another layout's value written over it) is a miss left in the store, whose size the
    fs store's index takes, so that lookups count it no more. An intact value of another
    layout is a miss that stays in the store. A value of a model no engine registered here is
    counted by a lookup that does not promote, and never promoted. A delete that hangs holds up no promotion; one
    that fails is a store error, counted, and the value stays (the fs store's delete cannot be
    made to hang: this last part swaps in a submit_delete whose future the test resolves)."""
    def layouts(key: ChunkKey) -> str | None:
        """Model "m" has a registered layout; "u" has none (no engine of it is registered)."""
        return FMT if key.model_name == "m" else None

    with in_process_tier(tmp_path, layouts) as (arena, index, tier, pump):
        size = 8192  # chunk_format_bytes(FMT)

        def payload(h: bytes) -> bytes:
            return h * (size // len(h))

        def store(model: str, hashes: list[bytes]) -> None:
            res, _, _ = index.reserve_write([ChunkKey(model, 1, 0, h) for h in hashes], FMT, size, 1, Usage())
            for _, e in res.entries:
                arena.memoryview(e.offset, e.size)[:] = payload(e.key.chunk_hash)
            tier.offer([e for _, e in index.commit_write(res)])

        def promote(model: str, hashes: list[bytes]) -> int:
            """Look the chunks up with promotion; the leading chunks readable in L1 afterwards."""
            lk = tier.begin_lookup(model, 1, hashes, index.lookup(model, 1, hashes))
            assert lk is not None
            pump(lk.done)
            tier.finish_lookup(lk, promote=True)
            pump(lambda: not tier.promoting)
            return index.lookup(model, 1, hashes)

        def value(key: ChunkKey, fmt: str = FMT, data: bytes | None = None) -> bytes:
            data = payload(key.chunk_hash) if data is None else data
            return encode_header(key, fmt, data) + data

        backend = tier.backend
        assert backend is not None
        hashes = [bytes([i]) * 16 for i in range(5)]
        keys = [ChunkKey("m", 1, 0, h) for h in hashes]
        l2 = [l2_key(k) for k in keys]
        store("m", hashes)
        pump(lambda: tier.writes == 5)
        assert len(index.clear()) == 5
        # chunk 0 stays good. Behind the tier's back: chunk 1's file loses its last bytes (the
        # store's index still says its old size); a bit of chunk 2 flips; chunk 3 gets another
        # layout of the same size, chunk 4 another format version (its header laid out otherwise),
        # which no writer of this version's keys makes
        (shortened,) = [p for p in (tmp_path / "l2").rglob("*") if p.is_file() and p.stat().st_size > HEADER_SIZE
                        and p.read_bytes()[HEADER_SIZE:] == payload(hashes[1])]
        with open(shortened, "r+b") as f:
            f.truncate(HEADER_SIZE + size - 100)
        flipped = bytearray(value(keys[2]))
        flipped[HEADER_SIZE + 7] ^= 0x01
        other_layout = value(keys[3], "float16:2x2x64x16")
        later_version = bytearray(value(keys[4]))
        later_version[4:6] = (2).to_bytes(2, "little")
        later_version[8:HEADER_SIZE] = bytes(HEADER_SIZE - 8)
        # model "u": a good value, which no engine registered here can load
        unloaded_key = ChunkKey("u", 1, 0, b"U" * 16)
        puts = [(l2[2], flipped), (l2[3], other_layout), (l2[4], later_version),
                (l2_key(unloaded_key), value(unloaded_key))]
        assert backend.submit_put([(k, [memoryview(v)]) for k, v in puts]).result(TIMEOUT) == [True] * 4

        assert promote("m", hashes) == 1, "only chunk 0 loads"
        assert all(k not in index.entries for k in keys[1:])
        promotions = tier.promotions
        assert promote("u", [b"U" * 16]) == 0 and tier.promotions == promotions, "nothing is promoted for no engine"
        lk = tier.begin_lookup("u", 1, [b"U" * 16], 0)
        assert lk is not None
        pump(lk.done)
        assert tier.finish_lookup(lk, promote=False) == (1, 1, 0), "a lookup that does not promote counts it"
        pump(lambda: tier.damaged_deleted == 2)
        assert (tier.integrity_failures, tier.promote_failures, tier.errors) == (3, 4, 0)
        sizes = backend.submit_exists([*l2, l2_key(unloaded_key)]).result(TIMEOUT)
        assert sizes == [HEADER_SIZE + size, HEADER_SIZE + size - 100, 0, HEADER_SIZE + size, 0, HEADER_SIZE + size]
        kept = bytearray(HEADER_SIZE + size)
        got = backend.submit_get([(l2[3], [memoryview(kept)])]).result(TIMEOUT)
        assert got == [GetStatus.HIT] and kept == other_layout, "an intact value of another layout is left alone"

        for start in (1, 2, 3):  # one of another size, a deleted one, one of another layout
            lk = tier.begin_lookup("m", 1, hashes[start:], 0)
            assert lk is not None
            pump(lk.done)
            assert tier.finish_lookup(lk, promote=False) == (0, 0, 0), f"chunk {start}'s value is no L2 hit"

        # stored again, chunks 1 and 2 are written to L2 (not skipped) and load byte for byte
        store("m", hashes[1:3])
        pump(lambda: tier.writes == 7)
        assert tier.write_skipped == 0
        assert len(index.clear()) == 3
        assert promote("m", hashes[:3]) == 3
        for k in keys[:3]:
            e = index.entries[k]
            assert bytes(arena.memoryview(e.offset, e.size)) == payload(k.chunk_hash)

        # a delete that does not answer holds up no promotion; when it fails, it is a store error
        hung: Future[int] = Future()
        backend.submit_delete = lambda keys: hung  # type: ignore[method-assign]
        assert backend.submit_put([(l2[1], [memoryview(flipped)])]).result(TIMEOUT) == [True]  # chunk 2's, here
        assert len(index.clear()) == 3
        assert promote("m", hashes[:3]) == 1
        assert (tier.promote_failures, tier.damaged_deleted, tier.errors) == (5, 2, 0)
        hung.set_exception(StoreUnavailable("store 'fs': delete failed: the store went away"))
        assert (tier.damaged_deleted, tier.errors) == (2, 1) and tier.breaker.closed
        assert backend.submit_exists([l2[1]]).result(TIMEOUT) == [HEADER_SIZE + size]


def test_lookups_meeting_values_of_another_size_do_not_flood_the_log(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """In process, with the real fs store, arena and index. A value of another size than the
    registered layout's chunk (another layout's, in a store two layouts share) is a miss each
    time a lookup meets it, and stays in the store: the warning comes at most once a second,
    with the count of those left out (one line per lookup once grew the log 0.5 MB a second).
    Nor is it a hit of the tier (every value of any size was, so values this server cannot load
    raised the tier's hit rate)."""
    registered = {"fmt": None}
    with in_process_tier(tmp_path, lambda key: registered["fmt"]) as (arena, index, tier, pump):
        hashes = [bytes([i]) * 16 for i in range(2)]
        only_in_l2(index, tier, pump, hashes, 8192)
        registered["fmt"] = "bfloat16:2x2x32x16"  # the model registered again with half the chunk

        def lookup() -> int:
            lk = tier.begin_lookup("m", 1, hashes, 0)
            assert lk is not None
            pump(lk.done)
            return tier.finish_lookup(lk, promote=True)[0]

        line = "needs 4096: ignored"
        chunks, hits = tier.lookup_chunks, tier.lookup_hits
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="kvxfer.server.tier"):
            for _ in range(100):
                assert lookup() == 0
            time.sleep(1.1)
            assert lookup() == 0
        lines = [r.getMessage() for r in caplog.records if line in r.getMessage()]
        assert 2 <= len(lines) <= time.monotonic() - start + 1, lines  # one a second, and the first
        assert "more since the last such line" in lines[-1], lines
        assert (tier.lookup_chunks - chunks, tier.lookup_hits - hits) == (202, 0)
        assert tier.backend is not None and tier.backend.submit_exists([l2_key(ChunkKey("m", 1, 0, hashes[0]))]
                                                                          ).result(TIMEOUT)[0] > 0, "the value stays"


def test_promotions_meeting_values_of_another_layout_do_not_flood_the_log(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """In process, with the real fs store, arena and index. Values of the same size as the
    registered chunk but another layout's (here another dtype) fail their promotion, each
    counted; one lookup of many such chunks (a client may name 16,384) logs one line, not one
    per chunk, and the next at most a second later, with the count of those left out."""
    registered = {"fmt": None}
    with in_process_tier(tmp_path, lambda key: registered["fmt"]) as (arena, index, tier, pump):
        hashes = [bytes([i]) * 16 for i in range(40)]
        only_in_l2(index, tier, pump, hashes, 8192)
        registered["fmt"] = FMT.replace("bfloat16", "float16")  # the model registered again in float16
        line = "is not loaded: "
        with caplog.at_level("WARNING", logger="kvxfer.server.tier"):
            lk = tier.begin_lookup("m", 1, hashes, 0)
            assert lk is not None
            pump(lk.done)
            assert tier.finish_lookup(lk, promote=True)[0] == 40  # counted: their size is right
            pump(lambda: not tier.promoting)
        assert tier.integrity_failures == 40
        lines = [r.getMessage() for r in caplog.records if line in r.getMessage()]
        assert 1 <= len(lines) <= 2, lines


def test_chunks_larger_than_the_store_holds_are_not_written_and_do_not_fail_it(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk (plus its header) larger than the store's largest value (Valkey: 512 MiB, past which
    it refuses the command and drops the connection) is not written: dropped and counted, logged
    at most once a second, and no store failure (each once counted as one, and three took L2
    down for every client). In process; the fs store holds values of 1 TiB, so its limit is
    lowered on the instance to one 8 KiB chunk cannot meet (a 512 MiB chunk is more than this
    VM's tests may allocate; the store object is the registry's, shared: put back after the test)."""
    from kvxfer.store import StoreCapabilities

    with in_process_tier(tmp_path) as (arena, index, tier, pump):
        monkeypatch.setattr(tier.store, "capabilities",
                            StoreCapabilities(shared=False, persistent=True, max_value_bytes=8192))
        with caplog.at_level("WARNING", logger="kvxfer.server.tier"):
            for i in range(5):
                offer(index, tier, [ChunkKey("big", 1, 0, bytes([i]) * 16)], 8192)
        assert tier.drops == 5 and tier.errors == 0 and tier.breaker.closed and tier.queue_depth == 0
        lines = [r.getMessage() for r in caplog.records if "more than the L2 store" in r.getMessage()]
        assert len(lines) == 1, lines
        offer(index, tier, [ChunkKey("small", 1, 0, b"s" * 16)], 4096)
        pump(lambda: tier.writes == 1)  # smaller chunks are written as ever


def test_every_dtype_a_kv_cache_may_have_has_its_chunk_size_in_l2() -> None:
    """A lookup that reaches L2 sizes the chunk from its format: every dtype a registration
    accepts must be known there (int8 and float64 chunks were written to L2 and never found)."""
    from kvxfer.layout import _dtypes
    from kvxfer.store.format import chunk_format_bytes

    for name, dtype in _dtypes().items():
        assert chunk_format_bytes(f"{name}:2x3x4x5") == dtype.itemsize * 120, name


def test_only_the_dropped_ranks_of_a_chunk_are_queued_again(tmp_path: Path) -> None:
    """In process: a chunk of two ranks whose rank 1 write was dropped (the store down) while
    rank 0's was written; a lookup that finds the chunk queues rank 1 only, and the write lands.
    Rank 0 of another such chunk leaving L1 does not forget that chunk's rank 1. (The breaker is
    opened by hand: an fs store in this process cannot be made unreachable.)"""
    with in_process_tier(tmp_path) as (arena, index, tier, pump):
        h, g = b"r" * 16, b"s" * 16
        offer(index, tier, [ChunkKey("m", 2, 0, h), ChunkKey("m", 2, 0, g)], 4096)
        pump(lambda: tier.writes == 2)
        closed = tier.breaker.closed
        tier.breaker.closed = False  # the store is down: the writes of rank 1 are dropped
        try:
            offer(index, tier, [ChunkKey("m", 2, 1, h), ChunkKey("m", 2, 1, g)], 4096)
        finally:
            tier.breaker.closed = closed
        assert tier.drops == 2 and tier.counts_hits
        tier.count_hits("m", 2, [h])
        assert tier.queue_depth == 1, "only rank 1 of the chunk is queued again"
        pump(lambda: tier.writes == 3 and tier.queue_depth == 0)
        assert tier.write_skipped == 0, "rank 0, written before, was not queued again"
        tier.forget([ChunkKey("m", 2, 0, g)])  # rank 0 of the other chunk left L1: rank 1 is still remembered
        tier.count_hits("m", 2, [g])
        pump(lambda: tier.writes == 4 and tier.queue_depth == 0)
        assert not tier.counts_hits


def test_the_writers_count_the_running_ones_and_none_after_close(tmp_path: Path) -> None:
    """``TierStatus.writers``: the writer threads running (``--l2-writers``, 2 by default), and
    none once the tier is closed and they have exited."""
    arena = Arena.create(1 << 20, tmp_path)
    tier = L2Tier(TierConfig("fs", f"file://{tmp_path}/l2", write_yield_s=0), ChunkIndex(arena.size), arena,
                  lambda fn: None, lambda key: None)
    try:
        tier.start()
        assert (tier.status().writers, tier.status().writers_held) == (2, 0)
        tier.close()
        assert (tier.status().writers, tier.status().writers_held) == (0, 0)
    finally:
        arena.close()


def test_a_rank_whose_context_closed_while_the_store_answered_is_not_promoted(tmp_path: Path) -> None:
    """In process, with the real fs store, arena and index. A lookup of a model of two ranks is
    planned while both ranks' contexts are registered; rank 1's closes while the store answers
    (no index change: the plan stands). Promotions of one size were reserved in the format of the
    group's first key, so rank 1's chunks were promoted in rank 0's layout, fixing a format on
    this server that no registered context names. Now each key's own registered format decides,
    and rank 1's chunk ends what the lookup counts."""
    registered = {0: FMT_4K, 1: FMT_4K}
    with in_process_tier(tmp_path, lambda key: registered.get(key.rank)) as (_arena, index, tier, pump):
        hashes = [bytes([i]) * 16 for i in range(2)]
        offer(index, tier, [ChunkKey("m", 2, r, h) for h in hashes for r in range(2)], 4096)
        pump(lambda: tier.writes == 4)
        assert len(index.clear()) == 4
        lk = tier.begin_lookup("m", 2, hashes, 0)
        assert lk is not None
        del registered[1]  # rank 1's context closes while the store answers
        pump(lk.done)
        hits, _, _ = tier.finish_lookup(lk, promote=True)
        pump(lambda: not tier.promoting)
        assert hits == 0
        assert not [k for k in index.entries if k.rank == 1], "rank 1's chunks were promoted"


def test_a_promotion_whose_model_was_registered_again_in_another_layout_loads_nothing(tmp_path: Path) -> None:
    """In process, with the real fs store, arena and index. While a lookup's chunks are promoted,
    its model's context closes and another registers the same model_name in another layout
    (a registration the server refuses while chunks of the old one are stored or being
    written: the promotion's entries count). The promotion ends with its chunks dropped and
    counted as failed: made readable in the old layout, they would have had every request of
    the new one that names them refused, not counted as a miss."""
    registered = {0: FMT}
    with in_process_tier(tmp_path, lambda key: registered.get(key.rank)) as (_arena, index, tier, pump):
        hashes = [bytes([i]) * 16 for i in range(2)]
        offer(index, tier, [ChunkKey("m", 1, 0, h) for h in hashes], 8192)
        pump(lambda: tier.writes == 2)
        assert len(index.clear()) == 2
        lk = tier.begin_lookup("m", 1, hashes, 0)
        assert lk is not None
        pump(lk.done)
        hits, _, _ = tier.finish_lookup(lk, promote=True)
        assert hits == 2 and tier.promoting
        assert index.format_of("m", 1) == FMT  # what a registration of another layout is refused for
        registered[0] = FMT_4K  # the context closed, and one of another layout registered
        pump(lambda: not tier.promoting)
        assert not index.entries and tier.promote_failures == 2 and tier.promoted == 0
        index.allocator.check()


def test_an_fs_store_whose_directory_is_removed_goes_down_within_seconds(tmp_path: Path) -> None:
    """The fs store answers lookups from its index in memory: its directory removed behind the
    server's back, those answers kept the breaker closed, the tier said `up` with the old
    figures, every write was dropped with no line in the log, and lookups promised L2 hits that
    the retrieve then missed. The tier's health cycle runs the store's own check (`ping`) too:
    within its period (5 s) the tier is down, saying why, and a WARNING says so."""
    kv = big_kv(4)
    root = tmp_path / "l2"
    with ServerProcess(l1_size="8MiB", chunk_size=CHUNK_SIZE, transports="cpu_gather",
                       extra_args=["--l2", "fs", "--l2-url", f"file://{root}"]) as srv, \
            CacheClient(srv.url, timeout=TIMEOUT) as c:
        ctx = c.register(kv, model_name="gone", block_size=BLOCK_SIZE, transport="cpu_gather")
        keys = [b"g" + bytes([i]) * 15 for i in range(2)]
        assert ctx.submit_store(keys, blocks_of(0, 2)).result(TIMEOUT).stored == [0, 1]
        settled(c, 2)
        assert c.status().tiers[0].state == "up"
        shutil.rmtree(root)
        tier = wait_until(lambda: (t := c.status().tiers[0]).state == "down" and t, 15.0, 0.1)
        assert "is gone" in tier.detail, tier
        assert "health check failed" in srv.log()
        ctx.close()


def test_a_store_failing_its_health_check_goes_down_only_after_failing_it_in_a_row(tmp_path: Path) -> None:
    """In process, with the real fs store: its directory moved away fails its health check (the
    tier's health cycle runs it every 5 s, and soon again after a failure). Once or twice, then
    back (a store busy for a moment: a slow Valkey fails its PING by timing out), the tier stays
    up: one failed check put it down at once. As many failures in a row as the breaker allows
    (3) put it down, however many lookups it answers meanwhile."""
    with in_process_tier(tmp_path) as (_arena, _index, tier, pump):
        root = tmp_path / "l2"
        pump(lambda: bool(tier.store_stats))  # the health thread's first cycle is over: its next is 5 s away
        assert tier._ping_store()
        for failures in (1, 2):
            root.rename(tmp_path / "away")
            for _ in range(failures):
                assert not tier._ping_store()
            (tmp_path / "away").rename(root)
            assert tier._ping_store() and tier.breaker.closed, failures
        root.rename(tmp_path / "away")
        for _ in range(tier.breaker.threshold - 1):
            assert not tier._ping_store() and tier.breaker.closed
            tier.breaker.success()  # an operation answered from memory meanwhile
        assert not tier._ping_store() and not tier.breaker.closed
        assert "is gone" in tier.breaker.last_error


def test_the_password_variable_is_named_alike_in_the_cli_and_the_store_contract() -> None:
    """``kvxfer.cli`` names it again (importing kvxfer.store would slow its parser down)."""
    from kvxfer.cli import L2_PASSWORD_ENV
    from kvxfer.store import PASSWORD_ENV, password_apart

    assert L2_PASSWORD_ENV == PASSWORD_ENV == "KVXFER_L2_PASSWORD"
    assert password_apart("valkeys://kv:p%40ss@h1:1,h2:2?ssl_cert_reqs=none") == \
        ("valkeys://kv@h1:1,h2:2?ssl_cert_reqs=none", {"KVXFER_L2_PASSWORD": "p@ss"})
    assert password_apart("valkey://:pw@h:1") == ("valkey://h:1", {"KVXFER_L2_PASSWORD": "pw"})
    assert password_apart("file:///var/l2") == ("file:///var/l2", {})
