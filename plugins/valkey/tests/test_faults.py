"""Valkey killed mid-store and mid-promote, restarted, hung (SIGSTOP), full (maxmemory), and
ACL users: nothing corrupt is ever loaded, the kvxfer server keeps serving from L1, no request
hangs, and L2 comes back by itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from valkey.crc import key_slot

from kvxfer import CacheClient
from kvxfer.store import GetStatus, StoreOptions
from kvxfer.testing.server import ServerProcess
from kvxfer_valkey import ValkeyCluster, ValkeyServer, ValkeyStore
from kvxfer_valkey.store import ACL_COMMANDS
from l2kit import BLOCK, CHUNK, TIMEOUT, blocks, chunks, kv, settle_writes, tier, wait_for

#: The tier's per-operation limit in these tests, and how long a lookup may take at most while
#: the store misbehaves (the limit plus the loop's 0.25 s tick plus a loaded machine's slack).
L2_TIMEOUT = 0.5
LOOKUP_BOUND = L2_TIMEOUT + 2.5
DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    node = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    with node:
        yield node


@pytest.fixture(scope="module")
def server(valkey: ValkeyServer) -> Iterator[ServerProcess]:
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather",
                       extra_args=["--l2", "valkey", "--l2-url", valkey.url, "--l2-timeout", str(L2_TIMEOUT)]) as srv:
        yield srv


@pytest.fixture
def healthy(valkey: ValkeyServer, server: ServerProcess) -> Iterator[CacheClient]:
    """A client of the server, with Valkey up and the tier back up before and after the test."""
    if valkey.proc is None or valkey.proc.poll() is not None:
        valkey.start()
    with CacheClient(server.url, timeout=TIMEOUT) as c:
        assert wait_for(lambda: tier(c).state == "up", 30), tier(c)
        yield c
    if valkey.proc is None or valkey.proc.poll() is not None:
        valkey.start()


def timed_lookup(c: CacheClient, model: str, keys: list[bytes]) -> tuple[int, float]:
    t = time.monotonic()
    hits = c.lookup(model, hashes=keys)
    return hits, time.monotonic() - t


def test_valkey_killed_mid_store_then_restarted(valkey: ValkeyServer, healthy: CacheClient,
                                                server: ServerProcess) -> None:
    c = healthy
    src = kv(10)
    ctx = c.register(src, model_name="killed-store", block_size=BLOCK, transport="cpu_gather")
    keys = [b"k" + bytes([i]) * 15 for i in range(16)]
    assert ctx.submit_store(keys, blocks(0, 16)).result(TIMEOUT).stored == list(range(16))
    valkey.kill()  # while the writers are at it (or just after)
    # the server keeps serving from L1: stores and byte-exact retrieves, lookups never hang
    more = [b"m" + bytes([i]) * 15 for i in range(4)]
    assert ctx.submit_store(more, blocks(20, 4)).result(TIMEOUT).stored == [0, 1, 2, 3]
    assert ctx.submit_retrieve(keys[:4], blocks(30, 4)).result(TIMEOUT).loaded == [0, 1, 2, 3]
    assert torch.equal(chunks(src, blocks(0, 4)), chunks(src, blocks(30, 4)))
    unknown = [b"u" + bytes([i]) * 15 for i in range(4)]
    for _ in range(5):
        hits, took = timed_lookup(c, "killed-store", unknown)
        assert hits == 0 and took < LOOKUP_BOUND, took
    assert wait_for(lambda: tier(c).state == "down", 10), tier(c)
    t = tier(c)
    assert t.errors >= 1 and t.outages >= 1 and "retrying" in t.detail
    hits, took = timed_lookup(c, "killed-store", unknown)
    assert hits == 0 and took < LOOKUP_BOUND
    # Valkey back (empty: no persistence): the tier finds it by itself, and new chunks reach it
    valkey.start()
    assert wait_for(lambda: tier(c).state == "up", 30), tier(c)
    before = tier(c).writes
    fresh = [b"f" + bytes([i]) * 15 for i in range(3)]
    ctx.submit_store(fresh, blocks(40, 3)).result(TIMEOUT)
    settle_writes(c, before + 3)
    assert c.clear("killed-store") >= 3
    reply = c.lookup_and_lease("killed-store", hashes=fresh, lease_s=30)
    assert (reply.hits, reply.l2_hits) == (3, 3), (tier(c), server.log()[-3000:])
    assert ctx.submit_retrieve(fresh, blocks(50, 3), lease_id=reply.lease_id).result(TIMEOUT).loaded == [0, 1, 2]
    assert torch.equal(chunks(src, blocks(40, 3)), chunks(src, blocks(50, 3)))
    ctx.close()


def test_valkey_killed_while_nothing_uses_it_shows_down_by_itself(valkey: ValkeyServer, healthy: CacheClient) -> None:
    """No store, no lookup: the status figures the server reads every few seconds fail, and so
    the tier shows down (and no stale size) within seconds, not up for ever."""
    c = healthy
    assert wait_for(lambda: tier(c).store_stats, 15), tier(c)
    valkey.kill()
    assert wait_for(lambda: tier(c).state == "down", 15), tier(c)
    t = tier(c)
    assert t.errors >= 1 and not t.store_stats and "retrying" in t.detail, t


def test_valkey_killed_mid_promote_loads_nothing_corrupt(valkey: ValkeyServer, healthy: CacheClient,
                                                        server: ServerProcess) -> None:
    """Two kvxfer servers share Valkey (two hosts): A stores, B looks the chunks up and promotes
    them, and Valkey is killed while B's promotion is under way (paused first, so that a kill
    that came after the promotion ended is not taken for one that came during it): B's retrieve
    loads each chunk byte for byte or reports it missing, and both servers serve on."""
    a = healthy
    src = kv(11)
    actx = a.register(src, model_name="killed-promote", block_size=BLOCK, transport="cpu_gather")
    with ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather",
                       extra_args=["--l2", "valkey", "--l2-url", valkey.url, "--l2-timeout", str(L2_TIMEOUT)]) as srv_b, \
            CacheClient(srv_b.url, timeout=TIMEOUT) as b:
        dst = kv(12)
        bctx = b.register(dst, model_name="killed-promote", block_size=BLOCK, transport="cpu_gather")
        for attempt in range(10):  # until a kill comes while chunks are still being promoted
            keys = [b"p%d" % attempt + bytes([i]) * 14 for i in range(24)]
            before = tier(a).writes
            actx.submit_store(keys, blocks(0, 24)).result(TIMEOUT)
            settle_writes(a, before + 24)
            reply = b.lookup_and_lease("killed-promote", hashes=keys, lease_s=30)
            assert reply.hits == 24 and reply.l2_hits == 24, reply
            valkey.pause()
            time.sleep(0.2)  # what Valkey had sent before is read: what is left waits for Valkey
            if tier(b).promoting:
                break
            valkey.resume()
            b.release_lease(reply.lease_id)
        else:
            pytest.fail("no promotion was still under way when Valkey was paused, in 10 attempts")
        valkey.kill()  # mid-promote
        res = bctx.submit_retrieve(keys, blocks(30, 24), lease_id=reply.lease_id).result(TIMEOUT)
        assert sorted(res.loaded + res.missing) == list(range(24)) and res.missing, res
        want, got, untouched = chunks(src, blocks(0, 24)), chunks(dst, blocks(30, 24)), chunks(kv(12), blocks(30, 24))
        for i in res.loaded:
            assert torch.equal(got[i], want[i]), f"chunk {i} loaded but not byte-exact"
        for i in res.missing:
            assert torch.equal(got[i], untouched[i]), f"chunk {i} reported missing but its blocks were written"
        t = tier(b)
        assert t.promote_failures >= 1 and t.promoting == 0, t
        # both servers still serve from L1: a store and a byte-exact retrieve each
        for c, ctx, layers in ((a, actx, src), (b, bctx, dst)):
            assert ctx.submit_store([b"after" + bytes(11)], blocks(60, 1)).result(TIMEOUT).stored == [0]
            assert ctx.submit_retrieve([b"after" + bytes(11)], blocks(62, 1)).result(TIMEOUT).loaded == [0]
            assert torch.equal(chunks(layers, blocks(60, 1)), chunks(layers, blocks(62, 1)))
            assert c.lookup("killed-promote", hashes=[b"none" * 4]) == 0
        bctx.close()
    actx.close()


def test_hung_valkey_costs_lookups_at_most_the_l2_timeout(valkey: ValkeyServer, healthy: CacheClient) -> None:
    c = healthy
    src = kv(13)
    ctx = c.register(src, model_name="hung", block_size=BLOCK, transport="cpu_gather")
    keys = [b"h" + bytes([i]) * 15 for i in range(4)]
    ctx.submit_store(keys[:2], blocks(0, 2)).result(TIMEOUT)
    valkey.pause()
    waited = 0
    try:
        for _ in range(4):
            before = tier(c)
            hits, took = timed_lookup(c, "hung", keys)
            assert hits == 2 and took < LOOKUP_BOUND, took  # L1's hits, the L2 part given up
            after = tier(c)
            if after.lookups > before.lookups and took >= L2_TIMEOUT:
                # it asked the store and waited it out: one timeout, whichever of the tier's timer
                # and the plugin's own silence limit ended it (the plugin's once counted an error only)
                assert after.timeouts == before.timeouts + 1, (before, after)
                waited += 1
        assert waited >= 1, "no lookup asked the paused store and waited it out"
        assert wait_for(lambda: tier(c).state == "down", 10)
        hits, took = timed_lookup(c, "hung", keys)
        assert hits == 2 and took < LOOKUP_BOUND
        assert tier(c).timeouts + tier(c).errors >= 1
    finally:
        valkey.resume()
    assert wait_for(lambda: tier(c).state == "up", 30), tier(c)
    ctx.close()


def test_a_hung_node_answers_probes_figures_and_deletes_within_the_l2_timeout(valkey: ValkeyServer,
                                                                              healthy: CacheClient) -> None:
    """Against a hung node, ``ping()``, ``stats()`` and ``delete()`` fail within ``timeout_s``
    every time, not only the first: each failure drops its connection, and the new one's
    handshake (CLIENT SETNAME) is bounded by ``timeout_s`` too, not by the bulk timeout (which
    the server then reported as a fault of the plugin: a ping() past its limit)."""
    from kvxfer.store import StoreUnavailable

    backend = ValkeyStore().open(valkey.url, StoreOptions(timeout_s=L2_TIMEOUT, bulk_timeout_s=30.0))
    try:
        backend.ping()
        valkey.pause()
        try:
            for call in [backend.ping, backend.ping, backend.stats, backend.stats,
                         lambda: backend.submit_delete([b"kvxfer:none"]).result(), backend.ping]:
                t = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    call()
                assert time.monotonic() - t < 10.0  # L2_TIMEOUT and a loaded machine's slack; not the 30 s
        finally:
            valkey.resume()
        assert wait_for(lambda: _pings(backend), 30)
    finally:
        backend.close()


def _pings(backend: object) -> bool:
    from kvxfer.store import StoreUnavailable

    try:
        backend.ping()  # type: ignore[attr-defined]
    except StoreUnavailable:
        return False
    return True


def test_a_key_a_third_party_made_another_type_is_a_miss_not_an_outage(valkey: ValkeyServer,
                                                                         healthy: CacheClient) -> None:
    """A kvxfer key that someone with write access turned into a list answers STRLEN and GET with
    WRONGTYPE: that chunk is a miss, on the loop connection and on the store threads alike, and
    the tier stays up for every other chunk (each lookup of it once counted as a store failure:
    three opened the breaker). A store of the chunk writes a value over it."""
    import valkey as valkey_py

    from kvxfer.server.index import ChunkKey
    from kvxfer.store.format import l2_key

    c = healthy
    layers = kv(11)
    ctx = c.register(layers, model_name="wrongtype", block_size=BLOCK, transport="cpu_gather")
    good = [b"g" + bytes([i]) * 15 for i in range(2)]
    bad = b"w" * 16
    before = tier(c)
    assert not ctx.submit_store(good, blocks(0, 2)).result(TIMEOUT).failed
    settle_writes(c, before.writes + before.write_skipped + 2)
    assert c.clear("wrongtype") == 2
    third = valkey_py.Valkey(host="127.0.0.1", port=valkey.port)
    try:
        third.rpush(l2_key(ChunkKey("wrongtype", 1, 0, bad)), b"x")
        for _ in range(5):
            assert c.lookup("wrongtype", hashes=[bad]) == 0
            assert c.lookup("wrongtype", hashes=good + [bad]) == 2  # the loop connection
        wide = [bad] * 4000 + good  # 292 KB of STRLEN, past what the loop connection sends: a store thread asks
        assert c.lookup("wrongtype", hashes=wide, promote=False) == 0
        backend = ValkeyStore().open(valkey.url, StoreOptions(timeout_s=2.0))
        try:  # the store threads' own paths: an existence check and a get
            key = l2_key(ChunkKey("wrongtype", 1, 0, bad))
            assert backend.submit_exists([key]).result(10) == [0]
            assert backend.submit_get([(key, [memoryview(bytearray(16))])]).result(10) == [GetStatus.MISS]
        finally:
            backend.close()
        after = tier(c)
        assert after.state == "up" and after.errors == before.errors and after.outages == before.outages, after
        assert not ctx.submit_store([bad], blocks(4, 1)).result(TIMEOUT).failed
        settle_writes(c, after.writes + after.write_skipped + 1)
        assert c.clear("wrongtype") == 1
        assert c.lookup("wrongtype", hashes=[bad]) == 1  # a value of ours now
    finally:
        third.close()
        ctx.close()


def test_wide_lookups_pipelined_by_one_client_do_not_take_the_tier_down(healthy: CacheClient) -> None:
    """One client pipelines lookups of 16,384 chunks of world size 2 (32,768 keys each, the most
    one lookup asks the store about): the server keeps at most 65,536 keys at the store at once
    and answers the others from L1 (counted as busy), and checks queued behind others are not
    taken for a node that stopped answering. The store stays up (such lookups once timed out in a
    queue of their own making, and each timeout opened the breaker a little more)."""
    import os

    from kvxfer.protocol import messages as m

    c = healthy
    before = tier(c)
    hashes = [os.urandom(16) for _ in range(16384)]
    futures = [c.submit(m.Lookup("wide", 2, hashes)) for _ in range(8)]
    for f in futures:
        assert f.result(timeout=120).hits == 0
    after = tier(c)
    assert after.state == "up" and after.outages == before.outages and after.errors == before.errors, after
    assert after.busy_lookups > before.busy_lookups, after
    assert after.lookups - before.lookups + after.busy_lookups - before.busy_lookups == 8


def test_full_valkey_evicts_or_refuses_and_nothing_breaks(tmp_path: Path) -> None:
    src = kv(14)
    keys = [b"x" + bytes([i]) * 15 for i in range(24)]  # 24 x 128 KiB into a 2 MiB Valkey
    for policy in ("allkeys-lru", "noeviction"):
        with ValkeyServer(tmp_path / policy, maxmemory="3mb", policy=policy) as node, \
                ServerProcess(l1_size="32MiB", chunk_size=CHUNK, transports="cpu_gather",
                              extra_args=["--l2", "valkey", "--l2-url", node.url]) as srv, \
                CacheClient(srv.url, timeout=TIMEOUT) as c:
            ctx = c.register(src, model_name="full", block_size=BLOCK, transport="cpu_gather")
            for i in range(0, 24, 4):
                assert ctx.submit_store(keys[i:i + 4], blocks(i, 4)).result(TIMEOUT).stored == [0, 1, 2, 3]
                assert wait_for(lambda: tier(c).queue_depth == 0, TIMEOUT)
            # a batch leaves the queue on its writer's thread and is counted on the loop just after
            assert wait_for(lambda: (t := tier(c)).writes + t.drops == 24, TIMEOUT), tier(c)
            t = tier(c)
            assert t.state == "up" and t.writes + t.drops == 24, t
            if policy == "noeviction":
                assert t.drops >= 1, "writes refused by a full Valkey are dropped and counted"
            c.clear("full")
            # what the store kept: the newest chunks when it evicts, the oldest when it refuses
            order = list(range(24))[::-1] if policy == "allkeys-lru" else list(range(24))
            in_l2 = c.lookup("full", hashes=[keys[i] for i in order])
            assert 0 < in_l2 < 24, (policy, in_l2)
            kept = order[:in_l2]
            reply = c.lookup_and_lease("full", hashes=[keys[i] for i in kept], lease_s=30)
            res = ctx.submit_retrieve([keys[i] for i in kept[:reply.hits]], blocks(30, reply.hits),
                                      lease_id=reply.lease_id).result(TIMEOUT)
            assert res.loaded, res
            want = chunks(src, blocks(0, 24))
            got = chunks(src, blocks(30, reply.hits))
            for j in res.loaded:
                assert torch.equal(got[j], want[kept[j]])
            ctx.close()


def docs_acl_rules() -> list[str]:
    """The rules of the ACL user docs/l2.md tells operators to create, after its password."""
    line = next(ln for ln in (DOCS / "l2.md").read_text().splitlines() if "ACL SETUSER kvxfer on >" in ln)
    return line.split()[5:]


def refused(node: ValkeyServer) -> list[str]:
    """What the node's ACL refused to run (commands, and commands on keys), from ``ACL LOG``."""
    lines = node.cli("ACL", "LOG").splitlines()  # each entry's fields: name, value, name, value, ...
    entries: list[dict[str, str]] = []
    for name, value in zip(lines[::2], lines[1::2]):
        if name == "count":
            entries.append({})
        entries[-1][name] = value
    return [e["object"] for e in entries if e.get("reason") in ("command", "key")]


def test_the_docs_acl_user_is_granted_the_commands_the_backend_sends() -> None:
    """docs/l2.md's ACL line and the error for refused credentials both come down to ACL_COMMANDS."""
    assert docs_acl_rules() == ["~kvxfer:*", "resetchannels", "-@all", *(f"+{c}" for c in ACL_COMMANDS)]


def test_acl_user_with_password_from_the_environment(valkey: ValkeyServer, tmp_path: Path) -> None:
    # the user docs/l2.md tells operators to create: kvxfer's keys and commands only
    valkey.cli("ACL", "LOG", "RESET")
    valkey.cli("ACL", "SETUSER", "kvx", "on", ">s3cret-pw", *docs_acl_rules())
    url = valkey.url.replace("valkey://", "valkey://kvx@")
    env = {"KVXFER_L2_PASSWORD": "s3cret-pw"}
    with ServerProcess(l1_size="16MiB", chunk_size=CHUNK, transports="cpu_gather", env=env,
                       extra_args=["--l2", "valkey", "--l2-url", url]) as srv:
        with CacheClient(srv.url, timeout=TIMEOUT) as c:
            t = tier(c)
            assert t.state == "up" and t.url == url.replace("kvx@", "kvx:***@")
            ctx = c.register(kv(15), model_name="acl", block_size=BLOCK, transport="cpu_gather")
            ctx.submit_store([b"acl" + bytes(13)], blocks(0, 1)).result(TIMEOUT)
            settle_writes(c, 1)
            c.clear("acl")
            reply = c.lookup_and_lease("acl", hashes=[b"acl" + bytes(13)], lease_s=30)
            assert (reply.hits, reply.l2_hits) == (1, 1)
            assert ctx.submit_retrieve([b"acl" + bytes(13)], blocks(1, 1), lease_id=reply.lease_id).result(
                TIMEOUT).loaded == [0]
            assert tier(c).errors == 0
            ctx.close()
        assert "s3cret-pw" not in srv.log()
    assert valkey.cli("--user", "kvx", "--pass", "s3cret-pw", "--no-auth-warning", "dbsize").strip() != "0"
    out = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--url", f"ipc://{tmp_path}/s.sock", "--l2",
                          "valkey", "--l2-url", url.replace("kvx@", "kvx:wrong@")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "refused kvxfer's credentials" in out.stderr, out.stderr
    assert "wrong" not in out.stderr.replace("kvx:***", "")
    assert refused(valkey) == [], "a command the user may not run was sent"


def test_the_docs_acl_user_on_a_cluster_while_a_slot_migrates(tmp_path: Path) -> None:
    """On a cluster the client also sends COMMAND when it starts and CLUSTER SLOTS: the docs' ACL
    user (on every node) runs all of it, a key whose slot is being migrated included (its ASK
    redirect is a miss, not followed)."""
    with ValkeyCluster(tmp_path / "c") as cluster:
        for n in cluster.nodes:
            n.cli("ACL", "SETUSER", "kvx", "on", ">s3cret-pw", *docs_acl_rules())
        url = ",".join(n.url.replace("valkey://", "valkey://kvx:s3cret-pw@") for n in cluster.nodes)
        backend = ValkeyStore().open(url, StoreOptions())
        try:
            keys = [b"kvxfer:acl:%d" % i for i in range(12)]
            assert backend.submit_put([(k, [memoryview(b"v")]) for k in keys]).result(TIMEOUT) == [True] * 12
            assert backend.submit_exists(keys).result(TIMEOUT) == [1] * 12
            assert backend.submit_get([(keys[0], [memoryview(bytearray(1))])]).result(TIMEOUT) == [GetStatus.HIT]
            backend.ping()
            assert backend.stats()["nodes"] == "3"
            # the owner of a migrating slot answers ASK for a key it lacks: a miss
            key = b"kvxfer:acl:migrating"
            owner = next(n for n in cluster.nodes if "MOVED" not in n.cli("GET", key.decode()))
            target = next(n for n in cluster.nodes if n is not owner)
            slot = str(key_slot(key))
            target.cli("CLUSTER", "SETSLOT", slot, "IMPORTING", owner.cli("CLUSTER", "MYID").strip())
            owner.cli("CLUSTER", "SETSLOT", slot, "MIGRATING", target.cli("CLUSTER", "MYID").strip())
            assert backend.submit_get([(key, [memoryview(bytearray(1))])]).result(TIMEOUT) == [GetStatus.MISS]
            assert backend.redirects == 1
            backend.submit_delete(keys).result(TIMEOUT)
            assert backend.submit_exists(keys).result(TIMEOUT) == [0] * 12
        finally:
            backend.close()
        for n in cluster.nodes:
            assert refused(n) == [], f"{n.address} refused commands kvxfer sent"


def test_a_cluster_that_refuses_a_command_the_client_needs_is_a_credentials_error(tmp_path: Path) -> None:
    """The cluster client's own start (COMMAND, CLUSTER SLOTS) refused: a configuration error,
    as on a single node, so that `kvxfer serve` stops and says which grant is missing rather
    than retrying a refusal for ever (valkey-py reports a refused CLUSTER SLOTS as a node not in
    cluster mode: the backend asks for the slots itself first)."""
    from kvxfer.errors import ConfigError

    with ValkeyCluster(tmp_path / "c") as cluster:
        for refused in ("-command", "-cluster|slots"):
            for n in cluster.nodes:
                n.cli("ACL", "SETUSER", "kvx", "reset", "on", ">s3cret-pw", *docs_acl_rules(), refused)
            url = ",".join(n.url.replace("valkey://", "valkey://kvx:s3cret-pw@") for n in cluster.nodes)
            with pytest.raises(ConfigError, match="refused kvxfer's credentials") as info:
                ValkeyStore().open(url, StoreOptions())
            assert "on a cluster COMMAND, CLUSTER SLOTS" in str(info.value), refused
            assert "s3cret-pw" not in str(info.value)
