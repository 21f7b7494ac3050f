"""Copy planning, shared by both sides: what a request may name, and which rows go where.

* :data:`MAX_CHUNKS_PER_REQUEST` bounds every request (client and server check it);
* :func:`check_transfer` validates a store's or retrieve's block ids;
* :func:`plan_copies` turns block ids and arena slots into :class:`RowCopy` lists, the unit
  every transport's copy code receives.

Neither side's machinery lives here: the client's data paths (:mod:`kvxfer.transport`) and the
server (:mod:`kvxfer.server.engine`) both call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from kvxfer.errors import ConfigError
from kvxfer.layout import KVLayout

__all__ = ["MAX_CHUNKS_PER_REQUEST", "RowCopy", "check_transfer", "plan_copies"]

#: Most chunks one request may name.
MAX_CHUNKS_PER_REQUEST: Final = 1 << 14


@dataclass(frozen=True, slots=True)
class RowCopy:
    """One copy between engine rows and one arena slot, for all layers at once.

    ``rows`` are row ids (int64, CPU) into each layer's row view (:meth:`KVLayout.row_view`);
    ``slot`` is ``[num_layers, len(rows), row_elems]`` of the layout's dtype, a view of the
    arena. Store copies ``layer_rows[rows] -> slot[layer]``; retrieve the reverse.
    """

    rows: torch.Tensor
    slot: torch.Tensor


def check_transfer(
    layout: KVLayout,
    chunk_size: int,
    n_keys: int,
    block_ids: Sequence[int] | torch.Tensor,
    skip_first_n_tokens: int = 0,
) -> torch.Tensor:
    """Validate a transfer's block ids; returns them as an int64 CPU tensor.

    Raises :class:`ConfigError` (client side) naming what is wrong: block count, range, skip.
    """
    bpc = layout.blocks_per_chunk(chunk_size)
    if n_keys > MAX_CHUNKS_PER_REQUEST:
        raise ConfigError(f"{n_keys} chunks in one request; at most {MAX_CHUNKS_PER_REQUEST}")
    try:
        blocks = torch.as_tensor(block_ids, dtype=torch.int64, device="cpu").reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"block_ids must be a sequence of integers: {exc}") from None
    if blocks.numel() != n_keys * bpc:
        raise ConfigError(
            f"{n_keys} chunks of {chunk_size} tokens need {n_keys * bpc} block ids "
            f"({bpc} per chunk at block_size {layout.block_size}), got {blocks.numel()}"
        )
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= layout.num_blocks):
        raise ConfigError(
            f"block ids must be in [0, {layout.num_blocks}); got min {int(blocks.min())}, max {int(blocks.max())}"
        )
    if skip_first_n_tokens < 0 or skip_first_n_tokens % layout.block_size:
        raise ConfigError(
            f"skip_first_n_tokens must be a non-negative multiple of the block size "
            f"{layout.block_size}, got {skip_first_n_tokens}"
        )
    return blocks


def plan_copies(
    layout: KVLayout,
    chunk_size: int,
    blocks: torch.Tensor,
    slots: Sequence[tuple[int, torch.Tensor]],
    skip_blocks: int = 0,
) -> list[RowCopy]:
    """RowCopies for ``slots`` (``(chunk index, uint8 slot tensor)``), skipping the first
    ``skip_blocks`` blocks of the request. A chunk with a partial skip gives one copy per run
    (the slot rows it needs are not contiguous across runs); fully skipped chunks none."""
    bpc = layout.blocks_per_chunk(chunk_size)
    copies = []
    for index, slot in slots:
        local_skip = min(bpc, max(0, skip_blocks - index * bpc))
        if local_skip == bpc:
            continue
        chunk_blocks = blocks[index * bpc + local_skip:(index + 1) * bpc]
        view = layout.chunk_rows_view(slot, chunk_size)  # [L, runs * bpc, row_elems]
        if local_skip == 0:
            copies.append(RowCopy(layout.rows(chunk_blocks), view))
            continue
        runs = view.view(layout.num_layers, layout.runs, bpc, layout.row_elems)
        rows = layout.rows(chunk_blocks).view(layout.runs, -1)
        for r in range(layout.runs):
            copies.append(RowCopy(rows[r], runs[:, r, local_skip:]))
    return copies
