"""The KV cache views vLLM builds, rebuilt without vLLM from ``vllm_kv_views.json`` (shapes,
strides and storage offsets recorded from vLLM's own code, see vllm_views.py) with
``torch.as_strided``, and round-tripped bit-exactly through every transport of the device:
cpu_gather and hpu on CPU; cuda_ipc, hpu and cpu_gather on CUDA (the GPU machine, which has no
vLLM: ``scripts/gpu_check.sh`` runs this file there). CUDA cases skip without a GPU.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import torch

import vllm_views as vv  # tests/integrations, on sys.path through conftest

from kvxfer import CacheClient
from kvxfer.testing import ServerProcess

CHUNK = 32
RECORD = vv.load()
HAS_CUDA = torch.cuda.is_available()
TRANSPORTS = {"cpu": ("cpu_gather", "hpu"), "cuda": ("cuda_ipc", "hpu", "cpu_gather")}


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def device_client(request: pytest.FixtureRequest) -> Iterator[tuple[str, CacheClient]]:
    device = request.param
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs an NVIDIA GPU (scripts/gpu_check.sh runs it on the GPU machine)")
    with ServerProcess(l1_size="64MiB", chunk_size=CHUNK, transports=",".join(TRANSPORTS[device])) as srv:
        c = CacheClient(srv.url, timeout=60, name=f"tests/vllm-views-{device}")
        yield device, c
        c.close()


@pytest.mark.parametrize("entry", RECORD["views"], ids=[f"{v['case']}-{v['layout']}" for v in RECORD["views"]])
def test_recorded_views_round_trip(device_client: tuple[str, CacheClient], entry: dict) -> None:
    device, client = device_client
    gen = torch.Generator().manual_seed(11)
    buf = torch.randint(0, 256, (entry["buffer_bytes"],), dtype=torch.uint8, generator=gen).to(device)
    groups = vv.rebuild(entry, buf)

    def through(name: str) -> vv.MakeContext:
        return lambda layers, bs, model: client.register(layers, model_name=model, block_size=bs, transport=name)

    contexts = {name: through(name) for name in TRANSPORTS[device]}
    vv.check_round_trips(buf, groups, contexts, f"rec-{entry['case']}-{entry['layout']}-{secrets.token_hex(4)}", CHUNK)


def test_the_record_names_its_vllm() -> None:
    assert RECORD["vllm"].startswith("0.32") and len(RECORD["views"]) >= 30
