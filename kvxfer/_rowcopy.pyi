"""Types of the C extension ``_rowcopy.c`` (its comments state the contract)."""

def copy_rows(to_slot: bool, slot: int, layer_ptrs: int, nlayers: int, span_rows: int, row_pitch: int,
              row_bytes: int, slot_layer_stride: int, slot_row_stride: int, rows: int, nrows: int,
              threads: int, /) -> int:
    """Copy ``rows`` (``nrows`` int64 ids at that address) of ``nlayers`` layers (uint64 base
    addresses at ``layer_ptrs``) to the slot (``to_slot``) or from it; sizes and strides in
    bytes. IndexError if a row id is outside ``[0, span_rows)``, before anything is copied.
    Returns the threads that copied (0: nothing to copy); a scatter that names a row twice
    runs on one thread (the row ends as its last write left it)."""

def kernel() -> str:
    """The copy in use: ``"avx-stream"``, ``"sse2-stream"`` or ``"memcpy"``."""

def _kernels() -> list[str]:
    """Tests only: the kernels this CPU runs, best first."""

def _use_kernel(name: str, /) -> None:
    """Tests only: use this kernel (a name from :func:`_kernels`)."""

def _fail_threads(fail: bool, /) -> None:
    """Tests only: start no thread, as if none could be."""
