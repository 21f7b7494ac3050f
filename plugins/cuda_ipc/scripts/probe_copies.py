#!/usr/bin/env python3
"""Diagnostics for cuda_ipc's copy pipeline on one GPU (no server): how long the pieces of one
8-chunk request take alone, so a benchmark ratio can be explained. Prints one line each."""

from __future__ import annotations

import mmap
import os
import time

import torch


def timed(fn, n: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best.append(time.perf_counter() - t)
    return sorted(best)[len(best) // 2]


def main() -> None:
    layers, nb, chunks, rows = 32, 1024, 8, 32          # 16 blocks x 2 planes per chunk
    row_elems = 16 * 8 * 128 * 2 // 16                  # one 32 KiB row as complex128
    kv = [torch.empty(2 * nb, row_elems, dtype=torch.complex128, device="cuda") for _ in range(layers)]
    idx = [torch.randperm(2 * nb, device="cuda")[:rows] for _ in range(chunks)]
    stage = torch.empty(chunks, layers, rows, row_elems, dtype=torch.complex128, device="cuda")
    host = torch.empty_like(stage, device="cpu").pin_memory()
    nbytes = stage.numel() * 16

    def gather() -> None:
        for c in range(chunks):
            for l in range(layers):
                torch.index_select(kv[l], 0, idx[c], out=stage[c, l])

    def scatter() -> None:
        for c in range(chunks):
            for l in range(layers):
                kv[l].index_copy_(0, idx[c], stage[c, l])

    def d2h() -> None:
        for c in range(chunks):
            host[c].copy_(stage[c], non_blocking=True)

    def h2d() -> None:
        for c in range(chunks):
            stage[c].copy_(host[c], non_blocking=True)

    def shm_buffer(flags: int) -> tuple[torch.Tensor, mmap.mmap]:
        """Like the server's arena: a /dev/shm file, pre-faulted, registered with cudaHostRegister."""
        path = f"/dev/shm/cuda-ipc-probe-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.close(fd)
        os.unlink(path)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, flags))
        return t.view(torch.complex128).view(stage.shape), mm

    for flags in (0, 3):
        shm, mm = shm_buffer(flags)

        def d2h_shm() -> None:
            for c in range(chunks):
                shm[c].copy_(stage[c], non_blocking=True)

        def h2d_shm() -> None:
            for c in range(chunks):
                stage[c].copy_(shm[c], non_blocking=True)

        print(f"registered /dev/shm (flags {flags}): is_pinned={shm.is_pinned()}")
        for name, fn in ((f"D2H 8 x 32 MiB into registered shm, flags {flags}", d2h_shm),
                         (f"H2D 8 x 32 MiB from registered shm, flags {flags}", h2d_shm)):
            t = timed(fn)
            print(f"{name}: {t * 1e3:.2f} ms = {nbytes / t / 1e9:.1f} GB/s")
        if flags == 3:
            try:
                from kvxfer_cuda_ipc import _kernels

                ptrs = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64, device="cuda")
                addrs = [torch.tensor([shm[c, l].data_ptr() for l in range(layers)], dtype=torch.int64, device="cuda")
                         for c in range(chunks)]

                def direct_store() -> None:
                    for c in range(chunks):
                        _kernels.gather_to(ptrs, idx[c], addrs[c], row_elems * 2, row_elems * 2)

                def direct_retrieve() -> None:
                    for c in range(chunks):
                        _kernels.scatter_from(ptrs, idx[c], addrs[c], row_elems * 2, row_elems * 2)

                def staged_store() -> None:
                    for c in range(chunks):
                        _kernels.gather(ptrs, idx[c], stage[c], row_elems * 2, row_elems * 2)
                        shm[c].copy_(stage[c], non_blocking=True)

                for name, fn in (("direct Triton gather into mapped shm", direct_store),
                                 ("direct Triton scatter from mapped shm", direct_retrieve),
                                 ("Triton gather + D2H, one stream", staged_store)):
                    t = timed(fn)
                    print(f"{name}: {t * 1e3:.2f} ms = {nbytes / t / 1e9:.1f} GB/s")
                direct_store()
                torch.cuda.synchronize()
                ok = all(torch.equal(shm[c, l].cpu(), kv[l][idx[c]].cpu()) for c in (0, chunks - 1) for l in (0, layers - 1))
                print(f"direct gather bit-exact: {ok}")
            except Exception as exc:
                print(f"direct kernels failed: {type(exc).__name__}: {exc}")
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(shm.data_ptr())
        del shm
        try:
            mm.close()
        except BufferError:  # views still alive in closures; the process exits soon
            pass

    t0 = time.perf_counter()
    for c in range(chunks):
        for l in range(layers):
            torch.index_select(kv[l], 0, idx[c], out=stage[c, l])
    launch = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"CPU time to launch {chunks * layers} index_select: {launch * 1e3:.2f} ms")
    for name, fn in (("gather 256 index_select", gather), ("scatter 256 index_copy_", scatter),
                     ("D2H 8 x 32 MiB", d2h), ("H2D 8 x 32 MiB", h2d)):
        t = timed(fn)
        print(f"{name}: {t * 1e3:.2f} ms = {nbytes / t / 1e9:.1f} GB/s of {nbytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
