"""The example plugin's tests: the conformance kit, plus what is particular to spool files
(they stay private, and a request cannot make the server touch a file outside them)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest
import torch

from kvxfer.errors import InvalidRequest
from kvxfer.protocol import codec
from kvxfer.protocol import messages as m
from kvxfer.testing import TransportConformance
from kvxfer.testing.harness import Kit
from kvxfer.transport import Transfer
from kvxfer_file_transport import FileContext, FileParams


class TestFileDebug(TransportConformance):
    transport = "file_debug"
    device = "cpu"

    def test_spool_files_are_private_and_removed_on_close(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        assert isinstance(ctx, FileContext)
        spool = Path(ctx.spool_dir)
        assert stat.S_IMODE(spool.stat().st_mode) == 0o700
        seen: list[int] = []
        real_prepare = ctx.prepare

        def prepare_and_look(transfer: Transfer) -> FileParams:
            params = real_prepare(transfer)
            seen.append(stat.S_IMODE((spool / params.file).stat().st_mode))
            return params

        ctx.prepare = prepare_and_look  # type: ignore[method-assign]  # observes, changes nothing
        kit.store(ctx, kit.keys(1), kit.blocks(spec, 1))
        assert seen == [0o600]
        assert list(spool.iterdir()) == [], "a request's spool file is deleted once it is finished"
        ctx.close()
        assert not spool.exists()

    @pytest.mark.parametrize("how", ["group-readable", "relative", "symlink", "missing"])
    def test_server_refuses_a_spool_dir_that_is_not_private(self, kit: Kit, tmp_path: Path, how: str) -> None:
        spec = kit.spec()
        ctx = kit.unregistered_context(kit.kv(spec), spec)
        target = tmp_path / "spool"
        target.mkdir(mode=0o700)
        if how == "group-readable":
            target.chmod(0o750)
            path = str(target)
        elif how == "relative":
            path = "spool"
        elif how == "symlink":
            (tmp_path / "link").symlink_to(target)
            path = str(tmp_path / "link")
        else:
            path = str(tmp_path / "nowhere")
        reg = msgspec.structs.replace(ctx.registration(), spool_dir=path)  # type: ignore[attr-defined]
        with pytest.raises(InvalidRequest, match=r"spool_dir: "):
            kit.client().request(m.Register(kit.name, msgspec.Raw(codec.encode(reg))))

    @pytest.mark.parametrize("name", ["../escape", "/etc/passwd", ".hidden", ""])
    def test_request_cannot_name_a_file_outside_the_spool_dir(self, kit: Kit, name: str) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        rows = ctx.layout.rows(torch.tensor(blocks)).tolist()
        params = msgspec.Raw(codec.encode(FileParams(name, rows)))
        with pytest.raises(InvalidRequest, match=r"params.file: "):
            kit.client().request(m.Store(ctx.instance_id, keys, blocks, params))
        assert kit.client().lookup(kit.model, 1, hashes=keys) == 0, "a failed store must store nothing"
        assert kit.store(ctx, keys, blocks).stored == [0], "the context works on after a refused request"

    def test_wrong_params_are_refused(self, kit: Kit) -> None:
        spec = kit.spec()
        ctx = kit.register(kit.kv(spec), spec)
        keys, blocks = kit.keys(1), kit.blocks(spec, 1)
        with pytest.raises(InvalidRequest, match=r"params: "):
            kit.client().request(m.Store(ctx.instance_id, keys, blocks, msgspec.Raw(codec.encode([1]))))
        short = FileParams("transfer-999", [0])  # a file that is not there
        with pytest.raises(InvalidRequest, match=r"params"):
            kit.client().request(m.Store(ctx.instance_id, keys, blocks,
                                                  msgspec.Raw(codec.encode(short))))
        assert os.path.isdir(ctx.spool_dir)
