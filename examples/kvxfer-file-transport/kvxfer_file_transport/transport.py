"""The file_debug transport: plugin object, registration and params Structs, both halves."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any

import msgspec
import torch

from kvxfer import ConfigError, RetrieveResult
from kvxfer.transport import (
    API_VERSION,
    Capabilities,
    KVLayout,
    Probe,
    Registration,
    RowCopy,
    ServerContext,
    ServerDrivenContext,
    Transfer,
    Transport,
)
from kvxfer_file_transport.spool import check_private_dir, read_file, write_file

__all__ = ["FileTransport", "FileContext", "FileServerContext", "FileRegistration", "FileParams"]

#: Where clients make their spool directories (default: the system's temporary directory).
SPOOL_ENV = "KVXFER_FILE_SPOOL"


class FileRegistration(Registration, frozen=True, kw_only=True):
    """The core's identity and layout fields, plus the client's private spool directory."""

    spool_dir: str


class FileParams(msgspec.Struct, frozen=True):
    """Per-request params: the spool file and the engine row ids it holds, in file order."""

    file: str
    rows: list[int]


class FileContext(ServerDrivenContext[FileParams]):
    """Client half: stage a store's rows in a file, place a retrieve's rows from one. Up to
    ``max_in_flight`` requests are at the server at once, each with its own file."""

    max_in_flight = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spool_dir = tempfile.mkdtemp(prefix="kvxfer-file-", dir=os.environ.get(SPOOL_ENV) or None)  # 0700
        self._dir_fd = check_private_dir(self.spool_dir)
        self._rows = [self.layout.row_view(t) for t in self.layers]
        self._names = itertools.count()

    def registration_extra(self) -> dict[str, Any]:
        return {"spool_dir": self.spool_dir}

    def prepare(self, transfer: Transfer) -> FileParams:
        name = f"transfer-{next(self._names)}"
        rows = self.layout.rows(transfer.blocks[transfer.skip_blocks:])
        if transfer.kind == "store":
            write_file(self._dir_fd, name, torch.stack([layer.index_select(0, rows) for layer in self._rows]))
        return FileParams(name, rows.tolist())

    def finish_retrieve(self, transfer: Transfer, params: FileParams | None, result: RetrieveResult) -> None:
        assert params is not None  # prepare() always makes them
        bpc, blocks = self.blocks_per_chunk, transfer.blocks
        loaded = torch.zeros(blocks.numel(), dtype=torch.bool)
        for i in result.loaded:
            loaded[i * bpc:(i + 1) * bpc] = True
        loaded[:transfer.skip_blocks] = False
        if loaded.any():
            data = _read(self._dir_fd, params, self.layout)
            want = self.layout.rows(blocks[loaded])
            pos = _positions(params.rows, want, self.layout)
            for layer, staged in zip(self._rows, data):
                layer.index_put_((want,), staged.index_select(0, pos))

    def release_params(self, transfer: Transfer, params: FileParams | None) -> None:
        if params is not None:
            try:
                os.unlink(params.file, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass  # a retrieve that loaded nothing leaves no file

    def release(self) -> None:
        os.close(self._dir_fd)
        shutil.rmtree(self.spool_dir, ignore_errors=True)


class FileServerContext(ServerContext[FileRegistration, FileParams]):
    """Server half of one registration: copies between spool files and arena slots."""

    def __init__(self, registration: FileRegistration, layout: KVLayout) -> None:
        super().__init__(registration, layout)
        self.dir_fd = check_private_dir(registration.spool_dir)

    def store(self, copies: list[RowCopy], params: FileParams) -> None:
        data = _read(self.dir_fd, params, self.layout)
        for c in copies:
            c.slot.copy_(data[:, _positions(params.rows, c.rows, self.layout)])

    def retrieve(self, copies: list[RowCopy], params: FileParams) -> None:
        lay = self.layout
        data = torch.zeros(lay.num_layers, len(params.rows), lay.row_elems, dtype=lay.dtype)
        for c in copies:
            data[:, _positions(params.rows, c.rows, lay)] = c.slot
        write_file(self.dir_fd, params.file, data)

    def close(self) -> None:
        os.close(self.dir_fd)


def _read(dir_fd: int, params: FileParams, layout: KVLayout) -> torch.Tensor:
    """The spool file of ``params`` as ``[num_layers, len(params.rows), row_elems]``."""
    n = len(params.rows)
    data = read_file(dir_fd, params.file, layout.num_layers * n * layout.row_bytes)
    return data.view(layout.dtype).view(layout.num_layers, n, layout.row_elems)


def _positions(file_rows: list[int], rows: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Where each of ``rows`` sits among ``file_rows``; :class:`ConfigError` if one is absent."""
    where = torch.full((layout.span_rows,), -1, dtype=torch.int64)
    if file_rows and (min(file_rows) < 0 or max(file_rows) >= where.numel()):
        raise ConfigError(f"params.rows: row ids must be in [0, {where.numel()})")
    where[torch.tensor(file_rows, dtype=torch.int64)] = torch.arange(len(file_rows))
    pos = where[rows]
    if pos.numel() and int(pos.min()) < 0:
        raise ConfigError("params.rows: the spool file lacks rows that the request names")
    return pos


class FileTransport(Transport):
    """Entry point ``file_debug``: never picked by "auto" (it exists for debugging)."""

    name = "file_debug"
    api_version = API_VERSION
    registration_type = FileRegistration
    context_type = FileContext
    server_context_type = FileServerContext
    capabilities = Capabilities(device_types=frozenset({"cpu"}))
    auto_priority = -100

    def probe(self) -> Probe:
        base = os.environ.get(SPOOL_ENV) or tempfile.gettempdir()
        if not os.access(base, os.W_OK | os.X_OK):
            return Probe(False, f"cannot write spool files in {base} (set {SPOOL_ENV})")
        return Probe(True, f"spool files under {base}", ("cpu",))
