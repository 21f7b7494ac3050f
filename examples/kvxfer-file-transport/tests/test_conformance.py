"""The example plugin's tests: the conformance kit, plus what is particular to spool files
(they live in a private directory the server makes, under names the transport derives; no
request can make the server open, create, truncate or write a path of its choosing)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import msgspec
import pytest
import torch

from kvxfer.errors import InvalidRequest
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.testing import TransportConformance
from kvxfer.testing.harness import Kit
from kvxfer.transport import Transfer, transport_dir_path
from kvxfer_file_transport import FileContext, FileParams
from kvxfer_file_transport.spool import MAX_SLOTS


def _raw(params: object) -> msgspec.Raw:
    return msgspec.Raw(codec.encode(params))


def _gone(path: Path, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


class TestFileDebug(TransportConformance):
    transport = "file_debug"
    device = "cpu"

    def test_spool_files_live_in_a_private_directory_of_the_server(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        assert isinstance(ctx, FileContext)
        kit.store(ctx, kit.keys(1), kit.blocks(spec, 1))  # the first request finds the directory
        spool = Path(ctx.spool_dir)
        assert spool.parent == transport_dir_path(kit.client().arena_path, "file_debug")
        assert spool.parent.parent == Path(kit.client().arena_path).parent  # next to the arena
        assert stat.S_IMODE(spool.stat().st_mode) == 0o700 and stat.S_IMODE(spool.parent.stat().st_mode) == 0o700
        seen: list[tuple[str, int]] = []
        real_prepare = ctx.prepare

        def prepare_and_look(transfer: Transfer) -> FileParams:
            params = real_prepare(transfer)
            path = spool / f"spool-{params.slot}"
            seen.append((path.name, stat.S_IMODE(path.stat().st_mode)))
            return params

        ctx.prepare = prepare_and_look  # type: ignore[method-assign]  # observes, changes nothing
        kit.store(ctx, kit.keys(2)[1:], kit.blocks(spec, 1))
        assert seen == [("spool-0", 0o600)]
        assert list(spool.iterdir()) == [], "a request's spool file is deleted once it is finished"
        ctx.close()
        assert _gone(spool), "the server removes a registration's directory when it closes it"

    def test_a_registration_cannot_choose_the_directory(self, kit: Kit, tmp_path: Path) -> None:
        """An older client's (or a hostile one's) ``spool_dir`` is ignored: the files stay in
        the server's own directory, and nothing appears in the one it named."""
        spec = kit.spec()
        ctx = kit.unregistered_context(kit.kv(spec), spec)
        named = tmp_path / "mine"
        named.mkdir(mode=0o700)
        reg = {**msgspec.structs.asdict(ctx.registration()), "spool_dir": str(named)}
        kit.client().request(m.Register(kit.name, _raw(reg)))
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        rows = ctx.layout.rows(torch.tensor(blocks)).tolist()
        for slot in range(2):
            with pytest.raises(InvalidRequest, match="params.slot"):  # no such spool file in its directory
                kit.client().request(m.Store(ctx.instance_id, keys, blocks, _raw(FileParams(slot, rows))))
        assert list(named.iterdir()) == []
        kit.client().request(m.Unregister(ctx.instance_id))

    @pytest.mark.parametrize("params", [
        {"file": "../escape", "rows": [0]}, {"file": "/etc/passwd", "rows": [0]},
        {"slot": -1}, {"slot": MAX_SLOTS}, {"slot": 1 << 40}, {"slot": "0"}, {"slot": 0, "rows": [-1]},
    ], ids=["old-file", "old-absolute", "negative", "past-the-last", "huge", "not-an-int", "bad-row"])
    def test_params_name_no_path(self, kit: Kit, params: dict) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        requests = [("store", m.Store(ctx.instance_id, keys, blocks, _raw(params)))]
        if "rows" not in params or "file" in params:  # refused as they decode, copies or not
            requests.append(("retrieve", m.Retrieve(ctx.instance_id, keys, blocks, params=_raw(params))))
        for name, payload in requests:
            with pytest.raises(InvalidRequest, match=r"params"):
                kit.client().request(payload)
        assert kit.client().lookup(kit.model, 1, hashes=keys) == 0, "a refused store must store nothing"
        assert kit.store(ctx, keys, blocks).stored == [0], "the context works on after a refused request"

    def test_a_planted_link_is_replaced_never_written_through(self, kit: Kit, tmp_path: Path) -> None:
        """A link put where a spool file goes (a symbolic link, or a hard link to the arena) is
        never followed: a retrieve replaces it with a new file, a store refuses to read it. The
        arena keeps its size (so nothing the server maps is ever truncated)."""
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        assert kit.store(ctx, keys, blocks).stored == [0]
        spool = Path(ctx.spool_dir)
        arena = Path(kit.client().arena_path)
        size = arena.stat().st_size
        victim = tmp_path / "victim"
        victim.write_bytes(b"precious")
        os.symlink(victim, spool / "spool-3")
        os.link(arena, spool / "spool-4")
        for slot in (3, 4):
            res = kit.client().request(m.Retrieve(ctx.instance_id, keys, blocks,
                                                             params=_raw(FileParams(slot))))
            assert res.loaded == [0]
            assert not (spool / f"spool-{slot}").is_symlink() and (spool / f"spool-{slot}").stat().st_nlink == 1
        assert victim.read_bytes() == b"precious" and arena.stat().st_size == size
        os.link(arena, spool / "spool-5")
        rows = ctx.layout.rows(torch.tensor(blocks)).tolist()
        with pytest.raises(InvalidRequest, match="not a plain file of its own"):
            kit.client().request(m.Store(ctx.instance_id, kit.keys(1), blocks, _raw(FileParams(5, rows))))
        assert arena.stat().st_size == size
        ctx.close()

    def test_wrong_params_are_refused(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        with pytest.raises(InvalidRequest, match=r"params: "):
            kit.client().request(m.Store(ctx.instance_id, keys, blocks, _raw([1])))
        short = FileParams(6, [0])  # a file that is not there
        with pytest.raises(InvalidRequest, match=r"params"):
            kit.client().request(m.Store(ctx.instance_id, keys, blocks, _raw(short)))
