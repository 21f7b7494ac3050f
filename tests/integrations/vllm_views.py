"""The KV cache views vLLM builds, made with vLLM's own code, and their record for machines
without vLLM.

:func:`build` runs the worker's own pipeline — ``get_kv_cache_groups`` (grouping layers, hybrid
models included), ``get_kv_cache_config_from_groups`` (the ``KVCacheTensor``\\ s: sizes, layer and
block strides, offsets, padding) and ``allocate_kv_cache`` (one buffer, per-layer views through
``create_kv_cache_views``, kernel blocks included) — for every ``KVCacheLayout`` of the installed
vLLM and each case of :data:`CASES`. Combinations vLLM itself refuses are skipped.

:func:`record` turns the result into plain data (buffer size, and per layer its group, shape,
strides and storage offset in elements of its dtype, and its group's block size), which
:func:`rebuild` turns back into views of a new buffer with ``torch.as_strided`` on any device. ``vllm_kv_views.json`` beside this
file holds the record of the vLLM this project tests with; regenerate it with
``python tests/integrations/vllm_views.py --write`` (a test fails when it is out of date).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

RECORD: Final = Path(__file__).with_name("vllm_kv_views.json")
BLOCK_SIZE: Final = 16
NUM_BLOCKS: Final = 24


@dataclass(frozen=True)
class Case:
    """Per-layer specs of a small model (built lazily: vLLM is imported only when used)."""

    name: str
    specs: Callable[[], dict[str, Any]]
    #: kernel block size per KV cache group (vLLM's kernel_block_sizes), or None
    kernel_block_size: int | None = None
    block_size: int = BLOCK_SIZE


def _full(dtype: torch.dtype = torch.float16, heads: int = 2, head: int = 8, block: int = BLOCK_SIZE, **kw: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype, **kw)


def _sliding(window: int = 2 * BLOCK_SIZE, heads: int = 2, head: int = 8) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=head, dtype=torch.float16,
                             sliding_window=window)


def _mla() -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=72, dtype=torch.bfloat16)


CASES: Final = (
    # K and V side by side in each layer's last dimension
    Case("full", lambda: {f"model.layers.{i}.attn": _full() for i in range(3)}),
    Case("mla", lambda: {f"model.layers.{i}.attn": _mla() for i in range(3)}),
    Case("sliding", lambda: {f"model.layers.{i}.attn": _sliding() for i in range(3)}),
    # pages padded to a larger block stride (as vLLM pads attention pages to a Mamba page)
    Case("padded", lambda: {f"model.layers.{i}.attn": _full(page_size_padded=_full().page_size_bytes + 96)
                            for i in range(3)}),
    # a block of 32 tokens split into kernel blocks of 16 (the backend's kernel_block_size)
    Case("kernel", lambda: {f"model.layers.{i}.attn": _full(block=2 * BLOCK_SIZE) for i in range(3)},
         kernel_block_size=BLOCK_SIZE, block_size=2 * BLOCK_SIZE),
    # hybrid attention: sliding-window and full layers, two KV cache groups
    Case("hybrid", lambda: {f"model.layers.{i}.attn": (_sliding() if i % 2 else _full()) for i in range(4)}),
    # hybrid with pages of two sizes: vLLM unifies them (a larger block for the smaller pages, or
    # pages packed side by side in block-outer layouts)
    Case("hybrid-pages", lambda: {f"model.layers.{i}.attn": (_sliding(heads=1) if i % 2 else _full())
                                  for i in range(4)}),
)


def layouts() -> list[Any]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(KVCacheLayout)


@dataclass
class Group:
    """One KV cache group as the worker holds it: its block size (vLLM may give each group its
    own) and its layers' views, in layer order."""

    group_id: int
    block_size: int
    layers: dict[str, torch.Tensor]


def build(case: Case, layout: Any) -> tuple[torch.Tensor, list[Group]] | str:
    """``(buffer, groups)`` as vLLM's worker allocates them for ``case`` under ``layout``, or
    why vLLM refuses the combination."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = layout.name
    cfg.cache_config.block_size = case.block_size
    try:
        specs = case.specs()
        groups = get_kv_cache_groups(cfg, dict(specs))
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        config = get_kv_cache_config_from_groups(cfg, groups, NUM_BLOCKS * page * len(specs))
        kernel = [case.kernel_block_size] * len(groups) if case.kernel_block_size else None
        views = allocate_kv_cache(config, torch.device("cpu"), layout, kernel)
    except (AssertionError, ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    first = next(iter(views.values()))
    buf = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    out = [Group(gid, g.kv_cache_spec.block_size, {name: views[name] for name in g.layer_names})
           for gid, g in enumerate(config.kv_cache_groups)]
    return buf, out


def record(case: Case, layout: Any) -> dict[str, Any] | None:
    built = build(case, layout)
    if isinstance(built, str):
        return None
    buf, groups = built
    layers = []
    for g in groups:
        for name, t in g.layers.items():
            layers.append({"group": g.group_id, "block_size": g.block_size, "name": name,
                           "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "stride": list(t.stride()), "offset": t.storage_offset()})
    return {"case": case.name, "layout": layout.name, "buffer_bytes": buf.numel(), "layers": layers}


def record_all() -> dict[str, Any]:
    import vllm

    out = [r for case in CASES for layout in layouts() if (r := record(case, layout)) is not None]
    return {"vllm": vllm.__version__, "views": out}


def rebuild(entry: dict[str, Any], buf: torch.Tensor) -> list[Group]:
    """The groups :func:`record` described, as views of ``buf`` (``uint8``, ``buffer_bytes``
    long, on any device) made with ``torch.as_strided``."""
    groups: dict[int, Group] = {}
    for layer in entry["layers"]:
        g = groups.setdefault(layer["group"], Group(layer["group"], layer["block_size"], {}))
        base = buf.view(getattr(torch, layer["dtype"]))
        g.layers[layer["name"]] = base.as_strided(layer["shape"], layer["stride"], layer["offset"])
    return [groups[k] for k in sorted(groups)]


def load() -> dict[str, Any]:
    return json.loads(RECORD.read_text())


if __name__ == "__main__":
    text = json.dumps(record_all(), indent=1) + "\n"
    if sys.argv[1:] == ["--write"]:
        RECORD.write_text(text)
        print(f"wrote {RECORD}")
    else:
        sys.stdout.write(text)


# --------------------------------------------------------------------------- round trips

#: Makes a registered context for ``layers`` (one group) under ``model_name``.
MakeContext = Callable[[list[torch.Tensor], int, str], Any]


def byte_view(t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``t`` (a view of ``buf``'s memory in any dtype) as the same view of ``buf`` (``uint8``)
    in bytes: its last dimension counts bytes."""
    item = t.element_size()
    return buf.as_strided([*t.shape[:-1], t.shape[-1] * item], [s * item for s in t.stride()[:-1]] + [1],
                          t.storage_offset() * item)


def check_round_trips(buf: torch.Tensor, groups: list[Group], contexts: dict[str, MakeContext], model: str,
                      chunk_size: int, seed: int = 0, chunks: int = 2) -> None:
    """Every group's blocks round-trip bit-exactly: for each transport in ``contexts``, chunks it
    stores are retrieved through the next one (the last through the first) into other blocks of
    the group, every second time skipping the first block; afterwards the whole buffer equals a
    reference built by plain byte indexing (the pages moved exactly, nothing else was written).
    Groups alias one buffer, so each uses its own block ids (a block belongs to one group)."""
    from kvxfer import chunk_hashes

    rng = torch.Generator().manual_seed(seed)
    ref = buf.clone()
    names = list(contexts)
    for g in groups:
        layers = list(g.layers.values())
        ctxs = {name: make(layers, g.block_size, f"{model}-g{g.group_id}") for name, make in contexts.items()}
        kernel = g.block_size // layers[0].shape[2]  # kernel blocks per block
        num_blocks = layers[0].shape[0] // kernel
        mine = torch.arange(g.group_id, num_blocks, len(groups))
        bpc = chunk_size // g.block_size
        for i, src_name in enumerate(names):
            dst_name = names[(i + 1) % len(names)]
            pick = mine[torch.randperm(mine.numel(), generator=rng)][: 2 * chunks * bpc]
            assert pick.numel() == 2 * chunks * bpc, "too few blocks for the round trip"
            src, dst = pick[: chunks * bpc].tolist(), pick[chunks * bpc:].tolist()
            keys = chunk_hashes(torch.randint(0, 1 << 30, (chunks * chunk_size,), generator=rng).tolist(), chunk_size)
            stored = ctxs[src_name].submit_store(keys, src).result(60)
            assert stored.stored == list(range(chunks)), f"{src_name}: {stored}"
            skip = i % 2
            loaded = ctxs[dst_name].submit_retrieve(keys, dst, skip_first_n_tokens=skip * g.block_size).result(60)
            assert loaded.loaded == list(range(chunks)), f"{dst_name}: {loaded}"
            for t in layers:
                ref_t = byte_view(t, ref)
                for s, d in list(zip(src, dst))[skip:]:
                    ref_t[d * kernel:(d + 1) * kernel] = ref_t[s * kernel:(s + 1) * kernel].clone()
            if not torch.equal(buf, ref):
                bad = (buf != ref).nonzero().flatten()
                raise AssertionError(f"group {g.group_id}: {src_name} -> {dst_name}: {bad.numel()} bytes differ "
                                     f"from the reference, first at byte {int(bad[0])}")
        for ctx in ctxs.values():
            ctx.close()
