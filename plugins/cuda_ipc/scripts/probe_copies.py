#!/usr/bin/env python3
"""Diagnostics for cuda_ipc's copy pipeline on one GPU (no server): how long the pieces of one
8-chunk request take alone, so a benchmark ratio can be explained. Prints one line each."""

from __future__ import annotations

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
