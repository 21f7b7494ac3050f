"""The file_debug transport: plugin object, registration and params Structs, both halves."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any, ClassVar

import msgspec
import torch

from kvxfer import ConfigError, RetrieveResult
from kvxfer.transport import (
    API_VERSION,
    Capabilities,
    Connection,
    InstanceIdentity,
    KVLayout,
    Probe,
    Registration,
    RowCopy,
    ServerContext,
    ServerDrivenContext,
    ServerTransport,
    Style,
    Transport,
)
from kvxfer_file_transport.spool import check_name, check_private_dir, read_file, write_file

__all__ = ["FileTransport", "FileContext", "FileRegistration", "FileParams"]

#: Where clients make their spool directories (default: the system's temporary directory).
SPOOL_ENV = "KVXFER_FILE_SPOOL"


class FileRegistration(Registration, frozen=True, kw_only=True):
    """The core's identity and layout fields, plus the client's private spool directory."""

    spool_dir: str


class FileParams(msgspec.Struct, frozen=True):
    """Per-request params: the spool file and the engine row ids it holds, in file order."""

    file: str
    rows: list[int]


# --------------------------------------------------------------------------- client side


class FileContext(ServerDrivenContext):
    """Client half: stage rows in a file before a store, place them after a retrieve.

    Up to ``max_in_flight`` requests are at the server at once, each with its own spool file
    (the core sends the next request while a reply travels back); a request's file is deleted
    once it is finished (:meth:`release_params`).
    """

    registration_type: ClassVar[type[Registration]] = FileRegistration
    max_in_flight: ClassVar[int] = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        base = os.environ.get(SPOOL_ENV) or None
        self.spool_dir = tempfile.mkdtemp(prefix="kvxfer-file-", dir=base)  # created 0700
        self._dir_fd = check_private_dir(self.spool_dir)
        self._rows = [self.layout.row_view(t) for t in self.layers]
        self._names = itertools.count()

    def registration_extra(self) -> dict[str, Any]:
        return {"spool_dir": self.spool_dir}

    def _new_file(self) -> str:
        return f"transfer-{next(self._names)}"

    def prepare_store(self, keys: list[bytes], blocks: torch.Tensor) -> FileParams:
        rows = self.layout.rows(blocks)
        name = self._new_file()
        write_file(self._dir_fd, name, torch.stack([layer.index_select(0, rows) for layer in self._rows]))
        return FileParams(name, rows.tolist())

    def prepare_retrieve(self, keys: list[bytes], blocks: torch.Tensor, skip_blocks: int) -> FileParams:
        return FileParams(self._new_file(), self.layout.rows(blocks[skip_blocks:]).tolist())

    def release_params(self, params: msgspec.Struct | None) -> None:
        if isinstance(params, FileParams):
            try:
                os.unlink(params.file, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass  # a retrieve that loaded nothing leaves no file

    def finish_retrieve(self, params: msgspec.Struct | None, result: RetrieveResult, blocks: torch.Tensor,
                        skip_blocks: int) -> None:
        assert isinstance(params, FileParams)
        bpc = self.blocks_per_chunk
        loaded = torch.zeros(blocks.numel(), dtype=torch.bool)
        for i in result.loaded:
            loaded[i * bpc:(i + 1) * bpc] = True
        loaded[:skip_blocks] = False
        if not loaded.any():
            return
        file_rows = torch.tensor(params.rows, dtype=torch.int64)
        lay = self.layout
        data = read_file(self._dir_fd, params.file, lay.num_layers * file_rows.numel() * lay.row_bytes)
        data = data.view(lay.dtype).view(lay.num_layers, file_rows.numel(), lay.row_elems)
        want = lay.rows(blocks[loaded])
        pos = _positions(file_rows, want, lay)
        for layer, staged in zip(self._rows, data):
            layer.index_put_((want,), staged.index_select(0, pos))

    def release(self) -> None:
        os.close(self._dir_fd)
        shutil.rmtree(self.spool_dir, ignore_errors=True)


def _positions(file_rows: torch.Tensor, rows: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Where each of ``rows`` sits among ``file_rows``; :class:`ConfigError` if one is absent."""
    where = torch.full((layout.span_rows,), -1, dtype=torch.int64)
    if file_rows.numel() and (int(file_rows.min()) < 0 or int(file_rows.max()) >= where.numel()):
        raise ConfigError(f"params.rows: row ids must be in [0, {where.numel()})")
    where[file_rows] = torch.arange(file_rows.numel())
    pos = where[rows]
    if pos.numel() and int(pos.min()) < 0:
        raise ConfigError("params.rows: the spool file lacks rows that the request names")
    return pos


# --------------------------------------------------------------------------- server side


class FileServerContext(ServerContext):
    """Server half of one registration: copies between spool files and arena slots."""

    params_type: ClassVar[type[msgspec.Struct] | None] = FileParams

    def __init__(self, dir_fd: int, layout: KVLayout) -> None:
        self.dir_fd = dir_fd
        self.layout = layout
        self.files = 0

    def _size(self, params: FileParams) -> int:
        return self.layout.num_layers * len(params.rows) * self.layout.row_bytes

    def store(self, copies: list[RowCopy], params: Any) -> None:
        if not isinstance(params, FileParams):
            raise ConfigError("params: a file_debug store needs FileParams")
        lay = self.layout
        rows = torch.tensor(params.rows, dtype=torch.int64)
        data = read_file(self.dir_fd, params.file, self._size(params))
        data = data.view(lay.dtype).view(lay.num_layers, rows.numel(), lay.row_elems)
        for c in copies:
            c.slot.copy_(data[:, _positions(rows, c.rows, lay)])
        self.files += 1

    def retrieve(self, copies: list[RowCopy], params: Any) -> None:
        if not isinstance(params, FileParams):
            raise ConfigError("params: a file_debug retrieve needs FileParams")
        lay = self.layout
        rows = torch.tensor(params.rows, dtype=torch.int64)
        data = torch.zeros(lay.num_layers, rows.numel(), lay.row_elems, dtype=lay.dtype)
        for c in copies:
            data[:, _positions(rows, c.rows, lay)] = c.slot
        write_file(self.dir_fd, check_name(params.file), data)
        self.files += 1

    def status(self) -> dict[str, str]:
        return {"files": str(self.files)}

    def close(self) -> None:
        os.close(self.dir_fd)


class FileServerTransport(ServerTransport):
    def open(self, registration: Registration, layout: KVLayout) -> ServerContext:
        if not isinstance(registration, FileRegistration):
            raise ConfigError("registration: file_debug needs a FileRegistration")
        return FileServerContext(check_private_dir(registration.spool_dir), layout)


# --------------------------------------------------------------------------- the plugin


class FileTransport(Transport):
    """Entry point ``file_debug`` of group ``kvxfer.transports``."""

    name = "file_debug"
    api_version = API_VERSION
    style = Style.SERVER_DRIVEN
    registration_type = FileRegistration
    capabilities = Capabilities(device_types=frozenset({"cpu"}))
    #: Never picked by "auto": it exists for debugging.
    auto_priority = -100

    def probe(self) -> Probe:
        base = os.environ.get(SPOOL_ENV) or tempfile.gettempdir()
        if not os.access(base, os.W_OK | os.X_OK):
            return Probe(False, f"cannot write spool files in {base} (set {SPOOL_ENV})")
        return Probe(True, f"spool files under {base}", ("cpu",))

    def client_context(self, connection: Connection, layers: list[torch.Tensor], layout: KVLayout,
                       identity: InstanceIdentity) -> FileContext:
        return FileContext(self.name, connection, layers, layout, identity)

    def server_transport(self) -> ServerTransport:
        return FileServerTransport()
