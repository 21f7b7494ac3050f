"""Triton kernels that gather/scatter one chunk's rows of every layer in a single launch.

With one ``index_select`` per layer, a chunk of 32 layers costs 32 kernel launches (~11 us of
CPU each on an H200 host), which is as long as the chunk's DMA copy: the copy engine would
wait for the CPU. These kernels take a device table of the layers' base addresses and move all
``layers x rows`` rows of a chunk in one launch. Without Triton (or when a kernel fails to
compile) the server falls back to the per-layer torch ops.

Rows are moved as int64 words; ``row_words`` is a row's size in 8-byte words and
``pitch_words`` the distance between consecutive rows of a layer's row view (see
:class:`kvxfer.KVLayout`: rows of a strided, padded or interleaved layout are further apart than
their length). Rows of the staging buffer or the arena slot are dense. The server uses the
kernels only when rows, pitch and layer bases are multiples of 8 bytes.

Triton compiles a kernel for each specialization of its arguments: integers equal to 1 or
divisible by 16, pointers 16-byte aligned or not. ``n_rows`` (which changes with
``skip_first_n_tokens``) is not specialized, and the server passes every pointer 16-byte aligned,
so once a context's first store and retrieve have run, later ones (layer ranges, skips) compile
nothing: the server may then queue them on its loop thread.
"""

from __future__ import annotations

import torch

__all__ = ["available", "gather", "scatter", "gather_to", "scatter_from"]

try:  # optional: the torch ops are the fallback
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (ImportError, or a broken install)
    triton = None

BLOCK = 1024  # int64 words per program: 8 KiB


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows"])
    def _gather_kernel(layer_ptrs, rows, out, n_rows, row_words, pitch_words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton kernel: its arguments are typed by the JIT
        pid = tl.program_id(0).to(tl.int64)   # layer * n_rows + r: the row's place in the chunk
        seg = tl.program_id(1).to(tl.int64)
        layer = pid // n_rows
        r = pid % n_rows
        src = tl.load(layer_ptrs + layer).to(tl.pointer_type(tl.int64))
        row = tl.load(rows + r)
        offs = seg * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        vals = tl.load(src + row * pitch_words + offs, mask=mask)
        tl.store(out + pid * row_words + offs, vals, mask=mask)

    @triton.jit(do_not_specialize=["n_rows"])
    def _scatter_kernel(layer_ptrs, rows, src, n_rows, row_words, pitch_words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton kernel: its arguments are typed by the JIT
        pid = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1).to(tl.int64)
        layer = pid // n_rows
        r = pid % n_rows
        dst = tl.load(layer_ptrs + layer).to(tl.pointer_type(tl.int64))
        row = tl.load(rows + r)
        offs = seg * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        vals = tl.load(src + pid * row_words + offs, mask=mask)
        tl.store(dst + row * pitch_words + offs, vals, mask=mask)


    @triton.jit(do_not_specialize=["n_rows"])
    def _gather_to_kernel(layer_ptrs, rows, out_ptrs, n_rows, row_words, pitch_words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton kernel: its arguments are typed by the JIT
        pid = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1).to(tl.int64)
        layer = pid // n_rows
        r = pid % n_rows
        src = tl.load(layer_ptrs + layer).to(tl.pointer_type(tl.int64))
        dst = tl.load(out_ptrs + layer).to(tl.pointer_type(tl.int64))
        row = tl.load(rows + r)
        offs = seg * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        vals = tl.load(src + row * pitch_words + offs, mask=mask)
        tl.store(dst + r * row_words + offs, vals, mask=mask)

    @triton.jit(do_not_specialize=["n_rows"])
    def _scatter_from_kernel(layer_ptrs, rows, src_ptrs, n_rows, row_words, pitch_words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton kernel: its arguments are typed by the JIT
        pid = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1).to(tl.int64)
        layer = pid // n_rows
        r = pid % n_rows
        dst = tl.load(layer_ptrs + layer).to(tl.pointer_type(tl.int64))
        src = tl.load(src_ptrs + layer).to(tl.pointer_type(tl.int64))
        row = tl.load(rows + r)
        offs = seg * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        vals = tl.load(src + r * row_words + offs, mask=mask)
        tl.store(dst + row * pitch_words + offs, vals, mask=mask)


def _grid(layer_ptrs: torch.Tensor, rows: torch.Tensor, row_words: int) -> tuple[int, int]:
    return (layer_ptrs.numel() * rows.numel(), (row_words + BLOCK - 1) // BLOCK)


def gather(layer_ptrs: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, row_words: int,
           pitch_words: int) -> None:
    """``out[l, i] = layer_l_rows[rows[i]]`` for every layer ``l`` (``out``: contiguous
    ``[layers, len(rows), row]``, any dtype; row ``r`` of layer ``l`` starts ``r * pitch_words``
    words after ``layer_ptrs[l]``), on the current stream."""
    n = rows.numel()
    if n:
        _gather_kernel[_grid(layer_ptrs, rows, row_words)](
            layer_ptrs, rows, out.view(torch.int64), n, row_words, pitch_words, BLOCK=BLOCK)


def scatter(layer_ptrs: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, row_words: int,
            pitch_words: int) -> None:
    """``layer_l_rows[rows[i]] = src[l, i]`` for every layer ``l``, on the current stream."""
    n = rows.numel()
    if n:
        _scatter_kernel[_grid(layer_ptrs, rows, row_words)](
            layer_ptrs, rows, src.view(torch.int64), n, row_words, pitch_words, BLOCK=BLOCK)


def gather_to(layer_ptrs: torch.Tensor, rows: torch.Tensor, out_ptrs: torch.Tensor, row_words: int,
              pitch_words: int) -> None:
    """Like :func:`gather` into ``len(layers)`` separate ``[len(rows), row]`` destinations whose
    addresses are ``out_ptrs`` (int64, on the device): e.g. the layers of an arena slot, which the
    kernel then writes over PCIe (host memory registered as mapped)."""
    n = rows.numel()
    if n:
        _gather_to_kernel[_grid(layer_ptrs, rows, row_words)](
            layer_ptrs, rows, out_ptrs, n, row_words, pitch_words, BLOCK=BLOCK)


def scatter_from(layer_ptrs: torch.Tensor, rows: torch.Tensor, src_ptrs: torch.Tensor, row_words: int,
                 pitch_words: int) -> None:
    """The reverse of :func:`gather_to`."""
    n = rows.numel()
    if n:
        _scatter_from_kernel[_grid(layer_ptrs, rows, row_words)](
            layer_ptrs, rows, src_ptrs, n, row_words, pitch_words, BLOCK=BLOCK)
