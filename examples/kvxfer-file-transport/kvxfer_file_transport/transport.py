"""The file_debug transport: plugin object, registration and params Structs, both halves.

Like every module a plugin's entry point imports, it imports torch only where tensors are
handled: ``kvxfer plugins`` then lists the plugin without importing torch.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import TYPE_CHECKING, Any

import msgspec

from kvxfer import ConfigError, RetrieveResult
from kvxfer.transport import (
    API_VERSION,
    Arena,
    Capabilities,
    KVLayout,
    Probe,
    Registration,
    RowCopy,
    ServerContext,
    ServerDrivenContext,
    ServerTransport,
    Transfer,
    Transport,
    transport_dir_path,
)
from kvxfer_file_transport.spool import MAX_SLOTS, file_name, open_private_dir, read_file, write_file

if TYPE_CHECKING:
    import torch

__all__ = ["FileTransport", "FileContext", "FileServerContext", "FileRegistration", "FileParams"]

NAME = "file_debug"


class FileRegistration(Registration, frozen=True, kw_only=True):
    """The core's identity and layout fields; nothing else (the server picks the directory)."""


class FileParams(msgspec.Struct, frozen=True):
    """Per-request params: which spool file (``slot``) and, for a store, the engine row ids the
    file holds, in file order. A retrieve's file holds the loaded chunks' rows in request order."""

    slot: int
    rows: list[int] = []

    def __post_init__(self) -> None:
        file_name(self.slot)  # a slot out of range fails decoding, whatever the request does


def spool_dir(root: str | os.PathLike[str], instance_id: int) -> str:
    """The directory of one registration inside the transport's private directory ``root``:
    the server makes it, the client finds it there."""
    return os.path.join(root, f"{instance_id:016x}")


class FileContext(ServerDrivenContext[FileParams]):
    """Client half: stage a store's rows in a file, place a retrieve's rows from one. Up to
    ``max_in_flight`` requests are at the server at once, each with a spool file (a slot) of its
    own until its params are released: once the server is done with the request (the core
    holds back the params of one whose answer the client stopped waiting for until the server
    answers it late). A slot released as not done (``Transfer.server_done`` False) is used
    again only in the next spool directory."""

    max_in_flight = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rows = [self.layout.row_view(t) for t in self.layers]
        self._spool_lock = threading.Lock()
        self._held: dict[int, int] = {}  # slot -> descriptor of the directory its request's file is in
        self._kept: set[int] = set()  # slots the server may still use (released as not done)
        self._dir_lock = threading.Lock()
        self.spool_dir = ""
        self._dir_fd = -1
        self._dir_id: tuple[int, int] = (0, 0)
        self._old_dirs: list[int] = []  # descriptors of the last directories replaced (a request may use one)

    def _directory(self) -> int:
        """The registration's spool directory, made by the server when it registered us, and made
        anew when we registered again (the server restarted, or ended our session), at the same
        path or another: opened again whenever the one at the path is another. None there means
        the server lost the registration: the session is opened again and the context registered
        (as a reply of ``no_session`` would have it done) before it is looked for again."""
        with self._dir_lock:  # (the worker's prepare and the finisher's finish_retrieve both ask)
            path = spool_dir(transport_dir_path(self.connection.arena_path, NAME), self.instance_id)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                self.connection.reconnect(self)
                path = spool_dir(transport_dir_path(self.connection.arena_path, NAME), self.instance_id)
                st = os.stat(path)
            if path != self.spool_dir or (st.st_dev, st.st_ino) != self._dir_id:
                fd = open_private_dir(path)
                fst = os.fstat(fd)
                if self._dir_fd >= 0:
                    self._old_dirs.append(self._dir_fd)
                    while len(self._old_dirs) > 2:
                        os.close(self._old_dirs.pop(0))
                self._dir_fd, self.spool_dir, self._dir_id = fd, path, (fst.st_dev, fst.st_ino)
                with self._spool_lock:
                    self._kept.clear()  # the old directory's files are nobody's in the new one
            return self._dir_fd

    def _take_slot(self, dir_fd: int) -> int:
        with self._spool_lock:
            for slot in range(MAX_SLOTS):
                if slot not in self._held and slot not in self._kept:
                    self._held[slot] = dir_fd
                    return slot
        raise RuntimeError(f"file_debug: every one of the {MAX_SLOTS} spool files is held by a request the server "
                           "has not answered yet (it may still be copying with it); they are free again as it answers")

    def prepare(self, transfer: Transfer) -> FileParams:
        import torch

        dir_fd = self._directory()
        slot = self._take_slot(dir_fd)
        if transfer.kind == "retrieve":
            return FileParams(slot)
        try:
            rows = self.layout.rows(transfer.blocks)
            write_file(dir_fd, file_name(slot), torch.stack([layer.index_select(0, rows) for layer in self._rows]))
        except BaseException:
            with self._spool_lock:
                del self._held[slot]
            raise
        return FileParams(slot, rows.tolist())

    def finish_retrieve(self, transfer: Transfer, params: FileParams | None, result: RetrieveResult) -> None:
        import torch

        assert params is not None  # prepare() always makes them
        bpc, lay, skip = self.blocks_per_chunk, self.layout, transfer.skip_blocks
        # the server wrote the rows of each loaded chunk (but the skipped blocks), chunk by chunk
        parts = [lay.rows(transfer.blocks[max(i * bpc, skip):(i + 1) * bpc])
                 for i in result.loaded if (i + 1) * bpc > skip]
        if not parts:
            return
        want = torch.cat(parts)
        # the layers the server wrote: one group's, for a part of a layer-wise retrieve
        layers = transfer.layers if transfer.layers is not None else range(lay.num_layers)
        # (the directory of the registration the server answered for: another than prepare's
        # after a restart, when the request was sent again)
        data = read_file(self._directory(), file_name(params.slot), len(layers) * want.numel() * lay.row_bytes)
        data = data.view(lay.dtype).view(len(layers), want.numel(), lay.row_elems)
        for layer, staged in zip([self._rows[i] for i in layers], data):
            layer.index_put_((want,), staged)

    def release_params(self, transfer: Transfer, params: FileParams | None) -> None:
        if params is None:
            return
        with self._spool_lock:
            dir_fd = self._held.pop(params.slot)
            if not transfer.server_done:  # the server may still write or read the file
                self._kept.add(params.slot)
                return
        try:
            os.unlink(file_name(params.slot), dir_fd=dir_fd)
        except OSError:
            pass  # a retrieve that loaded nothing leaves no file; a directory long replaced is closed

    def release(self) -> None:
        for fd in [*self._old_dirs, self._dir_fd]:
            if fd >= 0:
                os.close(fd)
        self._old_dirs, self._dir_fd = [], -1


def _positions(file_rows: torch.Tensor, rows: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Where each of ``rows`` sits among ``file_rows`` (nothing allocated beyond their sizes);
    :class:`ConfigError` if one is absent."""
    import torch

    if file_rows.numel() and (int(file_rows.min()) < 0 or int(file_rows.max()) >= layout.span_rows):
        raise ConfigError(f"params.rows: row ids must be in [0, {layout.span_rows})")
    ordered, order = torch.sort(file_rows)
    at = torch.searchsorted(ordered, rows).clamp_(max=max(ordered.numel() - 1, 0))
    if rows.numel() and (ordered.numel() == 0 or not torch.equal(ordered[at], rows)):
        raise ConfigError("params.rows: the spool file lacks rows that the request names")
    return order[at]


class FileServerContext(ServerContext[FileRegistration, FileParams]):
    """Server half of one registration: copies between spool files and arena slots, in the
    directory ``path`` its server transport made for it."""

    def __init__(self, registration: FileRegistration, layout: KVLayout, path: str) -> None:
        super().__init__(registration, layout)
        self.path = path
        self.dir_fd = open_private_dir(path)

    def store(self, copies: list[RowCopy], params: FileParams) -> None:
        import torch

        lay = self.layout
        data = read_file(self.dir_fd, file_name(params.slot), lay.num_layers * len(params.rows) * lay.row_bytes)
        rows = torch.tensor(params.rows, dtype=torch.int64)
        data = data.view(lay.dtype).view(lay.num_layers, rows.numel(), lay.row_elems)
        for c in copies:  # a store moves every layer (only retrieves come in ranges of layers)
            c.slot.copy_(data[:, _positions(rows, c.rows, lay)])

    def retrieve(self, copies: list[RowCopy], params: FileParams) -> None:
        import torch

        data = torch.cat([c.slot for c in copies], dim=1)  # the copies' rows, in request order
        write_file(self.dir_fd, file_name(params.slot), data)

    def close(self) -> None:
        os.close(self.dir_fd)
        shutil.rmtree(self.path, ignore_errors=True)


class FileServerTransport(ServerTransport):
    """Keeps every registration's spool directory in the private directory the server gives the
    transport (:meth:`kvxfer.transport.Arena.transport_dir`)."""

    def __init__(self, transport: Transport) -> None:
        super().__init__(transport)
        self.root = ""

    def start(self, arena: Arena) -> None:
        self.root = str(arena.transport_dir(NAME))

    def open(self, registration: Registration, layout: KVLayout) -> FileServerContext:
        assert isinstance(registration, FileRegistration)  # the core decoded it as registration_type
        path = spool_dir(self.root, registration.instance_id)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            raise ConfigError(f"instance_id: {registration.instance_id} is being registered already") from None
        return FileServerContext(registration, layout, path)


class FileTransport(Transport):
    """Entry point ``file_debug``: never picked by "auto", and not meant for production (a
    server loads it only when ``--transports`` names it): it exists for debugging."""

    name = NAME
    api_version = API_VERSION
    registration_type = FileRegistration
    context_type = FileContext
    #: layer_ranges: a layer-wise retrieve comes as one request per group of layers; the server
    #: writes, and finish_retrieve reads, only that group's layers (Transfer.layers)
    capabilities = Capabilities(device_types=frozenset({"cpu"}), layer_ranges=True)
    auto_priority = -100
    production = False

    def probe(self) -> Probe:
        return Probe(True, "spool files in a private directory of the server, next to its arena", ("cpu",))

    def server_transport(self) -> ServerTransport:
        return FileServerTransport(self)


assert FileContext.max_in_flight <= MAX_SLOTS
