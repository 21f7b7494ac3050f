"""The copy kernels' table of layer addresses: every slice a retrieve of a layer range asks for
starts 16-byte aligned and holds that range's addresses, from two tables made once, whatever
ranges clients name (a cache of aligned copies per odd range grew by one device tensor per range
a client named, for the registration's life). Runs on the CPU, and on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from kvxfer_cuda_ipc.server import LayerTable

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_every_range_is_aligned_and_holds_its_layers_addresses(device: str) -> None:
    layers = 61  # an odd count: the last layer's range from an odd first layer too
    addresses = [0x7F00_0000_0000 + 4096 * i for i in range(layers)]
    table = LayerTable(addresses, torch.device(device))
    for first in range(layers):
        for count in range(1, layers - first + 1):
            got = table.slice(first, count)
            assert got.data_ptr() % 16 == 0, (first, count)
            assert got.tolist() == addresses[first:first + count], (first, count)


def test_its_memory_does_not_grow_with_the_ranges_asked_for() -> None:
    table = LayerTable(list(range(1, 1001)), torch.device("cpu"))
    storages = {table.slice(first, count).untyped_storage().data_ptr()
                for first in range(0, 1000, 7) for count in (1, 2, 3)}
    assert len(storages) == 2  # the table and its shifted copy, nothing per range
