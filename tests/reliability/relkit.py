"""Helpers shared by the reliability tests, their worker processes and benchmarks/soak.py.

Chunk contents are a pure function of (model, rank, chunk hash): any process can write a
chunk, and any other can check a retrieved one bit for bit without talking to the writer.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_worker.py"


@dataclass(frozen=True)
class Shape:
    """A flash-attention paged KV cache ``[2, num_blocks, block_size, heads, head_dim]`` per layer."""

    layers: int = 2
    num_blocks: int = 64
    block_size: int = 16
    heads: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16

    def make(self) -> list[torch.Tensor]:
        return [torch.zeros(2, self.num_blocks, self.block_size, self.heads, self.head_dim, dtype=self.dtype)
                for _ in range(self.layers)]

    def chunk_bytes(self, chunk_size: int) -> int:
        return self.layers * 2 * chunk_size * self.heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def args(self) -> list[str]:
        return ["--layers", str(self.layers), "--num-blocks", str(self.num_blocks), "--block-size",
                str(self.block_size), "--heads", str(self.heads), "--head-dim", str(self.head_dim)]


def key(model: str, n: int) -> bytes:
    """The n-th chunk hash of a test workload (16 bytes, like kvxfer.chunk_hashes)."""
    return hashlib.blake2b(f"{model}/{n}".encode(), digest_size=16).digest()


def expected(shape: Shape, model: str, rank: int, h: bytes, bpc: int) -> torch.Tensor:
    """The content of chunk ``h`` of ``rank``: ``[layers, 2, bpc, block_size, heads, head_dim]`` as int16 bits."""
    seed = int.from_bytes(hashlib.blake2b(model.encode() + rank.to_bytes(4, "little") + h, digest_size=8).digest(),
                          "little") & ((1 << 63) - 1)
    g = torch.Generator().manual_seed(seed)
    n = shape.layers * 2 * bpc * shape.block_size * shape.heads * shape.head_dim
    bits = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=g)
    return bits.view(shape.layers, 2, bpc, shape.block_size, shape.heads, shape.head_dim)


def write_chunk(kv: list[torch.Tensor], blocks: list[int], bits: torch.Tensor) -> None:
    idx = torch.tensor(blocks)
    for layer, b in zip(kv, bits):
        layer.view(torch.int16)[:, idx] = b


def read_chunk(kv: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    idx = torch.tensor(blocks)
    return torch.stack([layer.view(torch.int16)[:, idx] for layer in kv])


def checksum(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def proc_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` figure in KiB (``VmRSS``, ``VmHWM``: the peak of VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class RawPeer:
    """A bare connection that speaks the wire protocol by hand (any payload, any fields)."""

    def __init__(self, url: str, *, rcvbuf: int | None = None) -> None:
        from kvxfer.protocol import codec
        from kvxfer.testing.wire import RawConnection

        self.codec = codec
        self.conn = RawConnection(url, rcvbuf=rcvbuf)
        self.rid = 0
        self.last_handshake = 0.0

    def send(self, name: bytes, payload: bytes) -> int:
        self.rid += 1
        self.conn.send([self.codec.pack_id(self.rid), name, payload])
        return self.rid

    def recv(self, rid: int, timeout: float = 15.0) -> tuple[bytes, bytes] | None:
        """The reply to ``rid`` (earlier replies, e.g. to dropped frames, are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            frames = self.conn.recv(left) if left > 0 else None
            if frames is None:
                return None
            assert len(frames) == 3, f"a reply has 3 frames, got {len(frames)}"
            got = self.codec.unpack_id(frames[0])
            if got == rid:
                return frames[1], frames[2]
            assert got < rid, f"a reply to request {got}, never sent"

    def call(self, name: bytes, payload: bytes, timeout: float = 15.0) -> tuple[bytes, bytes]:
        if time.monotonic() - self.last_handshake > 0.5:
            # keep the session: only well-formed requests count as signs of life
            self.handshake()
        rid = self.send(name, payload)
        out = self.recv(rid, timeout)
        assert out is not None, f"no reply to {name!r} ({len(payload)} bytes) within {timeout} s"
        return out

    def handshake(self, **fields: object) -> dict:
        """Handshake with ``fields`` besides the version (any, e.g. an old client's
        ``client_token``); returns the reply as a dict."""
        import msgspec

        from kvxfer.protocol import messages as m

        payload = {"protocol_version": m.PROTOCOL_VERSION, "client_name": "raw", "pid": os.getpid(), **fields}
        rid = self.send(b"handshake", self.codec.encode(payload))
        out = self.recv(rid)
        assert out is not None and out[0] == self.codec.OK, out
        self.last_handshake = time.monotonic()
        return msgspec.msgpack.decode(out[1])

    def error(self, name: bytes, payload: bytes, timeout: float = 15.0) -> tuple[str, str] | None:
        """``(code, message)`` of an error reply, None for an ok one."""
        status, reply = self.call(name, payload, timeout)
        if status == self.codec.OK:
            return None
        err = self.codec.ERROR_DECODER.decode(reply)
        return err.code, err.message

    def close(self) -> None:
        self.conn.close()


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_worker(*args: str) -> subprocess.Popen[str]:
    """A worker process (``_worker.py``); it prints one JSON object per line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def read_event(proc: subprocess.Popen[str], want: str | tuple[str, ...], timeout: float = 60.0) -> dict:
    """Next JSON line of ``proc`` whose ``event`` is ``want`` (or one of them; others are skipped).
    Reads the pipe's descriptor itself, keeping what follows a line for the next call: a
    buffered ``readline`` took two lines sent together, and the descriptor then said nothing was
    left, so the second was never seen."""
    import selectors

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf: bytes = getattr(proc, "_event_buffer", b"")
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                proc._event_buffer = buf  # type: ignore[attr-defined]
                ev = json.loads(line)
                if ev.get("event") == "error":
                    raise RuntimeError(f"worker failed: {ev.get('error')}")
                if ev.get("event") == want or (isinstance(want, tuple) and ev.get("event") in want):
                    return ev
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"worker {proc.args[2:4]} sent no {want!r} event in {timeout} s")
            data = os.read(fd, 1 << 16)
            if not data:
                err = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"worker exited ({proc.wait()}) before {want!r}:\n{err[-4000:]}")
            buf += data
            proc._event_buffer = buf  # type: ignore[attr-defined]
    finally:
        sel.close()


def wait_until(fn, timeout: float, what: str, interval: float = 0.1):
    """Poll ``fn`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen within {timeout} s (last: {last!r})")


class Writer:
    """An in-process registered KV cache that stores and checks workload chunks."""

    def __init__(self, client, shape: Shape = Shape(), model: str = "m", world: int = 1, rank: int = 0) -> None:
        self.client = client
        self.shape = shape
        self.model = model
        self.rank = rank
        self.kv = shape.make()
        self.ctx = client.register(self.kv, model_name=model, world_size=world, rank=rank,
                                   block_size=shape.block_size, transport="cpu_gather")
        self.bpc = client.chunk_size // shape.block_size

    def blocks(self, n: int, base: int = 0) -> list[int]:
        return list(range(base * self.bpc, (base + n) * self.bpc))

    def store(self, keys: list[bytes], timeout: float = 30.0):
        ids = self.blocks(len(keys))
        for j, h in enumerate(keys):
            write_chunk(self.kv, ids[j * self.bpc:(j + 1) * self.bpc],
                        expected(self.shape, self.model, self.rank, h, self.bpc))
        return self.ctx.submit_store(keys, ids).result(timeout=timeout)

    def retrieve(self, keys: list[bytes], timeout: float = 30.0, lease_id: int = 0):
        """Retrieve into the upper half of the blocks; returns (result, indices that are not bit-exact)."""
        base = self.shape.num_blocks // self.bpc // 2
        assert len(keys) <= base, "too many chunks for one retrieve"
        ids = self.blocks(len(keys), base)
        idx = torch.tensor(ids)
        for layer in self.kv:
            layer.index_fill_(1, idx, 0)  # (layer[:, ids].zero_() would zero a copy)
        res = self.ctx.submit_retrieve(keys, ids, lease_id=lease_id).result(timeout=timeout)
        bad = [j for j in res.loaded
               if not torch.equal(read_chunk(self.kv, ids[j * self.bpc:(j + 1) * self.bpc]),
                                  expected(self.shape, self.model, self.rank, keys[j], self.bpc))]
        return res, bad


class TcpServer:
    """``kvxfer serve --url tcp://127.0.0.1:PORT --curve-dir DIR`` in a subprocess.

    (ServerProcess waits for its server with a keyless client, which a CURVE server refuses.)
    """

    def __init__(self, curve_dir: Path, l1_size: str = "32MiB", chunk_size: int = 64) -> None:
        import tempfile

        self.url = f"tcp://127.0.0.1:{free_port()}"
        self.curve_dir = curve_dir
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvxfer", "serve", "--url", self.url, "--curve-dir", str(curve_dir),
             "--l1-size", l1_size, "--chunk-size", str(chunk_size), "--transports", "cpu_gather"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait_ready(self, keys, timeout: float = 30.0) -> None:
        from kvxfer import CacheClient, ConnectionFailed

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                CacheClient(self.url, connect_timeout=0.5, curve=keys).close()
                return
            except ConnectionFailed:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tcp server not ready:\n{self.log()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
