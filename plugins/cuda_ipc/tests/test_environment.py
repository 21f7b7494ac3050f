"""The KVXFER_CUDA_IPC_* variables are checked, not taken for their default when misspelt. Runs
without a GPU: the checks read only the environment (CudaIpcServerTransport.start calls
check_environment before it touches CUDA)."""

from __future__ import annotations

import pytest

from kvxfer import ConfigError
from kvxfer_cuda_ipc import server


@pytest.mark.parametrize(("name", "value"), [
    ("KVXFER_CUDA_IPC_MODE", "Direct"), ("KVXFER_CUDA_IPC_MODE", "zero-copy"),
    ("KVXFER_CUDA_IPC_KERNEL", "TORCH"), ("KVXFER_CUDA_IPC_KERNEL", "cuda"),
    ("KVXFER_CUDA_IPC_STAGING_MIB", "0"), ("KVXFER_CUDA_IPC_STAGING_MIB", "-5"),
    ("KVXFER_CUDA_IPC_STAGING_MIB", "1e3"), ("KVXFER_CUDA_IPC_STAGING_MIB", str(1 << 40)),
])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        server.check_environment()


def test_defaults_and_good_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVXFER_CUDA_IPC_MODE", "KVXFER_CUDA_IPC_KERNEL", "KVXFER_CUDA_IPC_STAGING_MIB"):
        monkeypatch.delenv(name, raising=False)
    server.check_environment()
    assert (server.mode(), server.kernel(), server._staging_bytes()) == ("staged", "triton", 128 << 20)
    monkeypatch.setenv("KVXFER_CUDA_IPC_MODE", "direct")
    monkeypatch.setenv("KVXFER_CUDA_IPC_KERNEL", "torch")
    monkeypatch.setenv("KVXFER_CUDA_IPC_STAGING_MIB", "1")
    server.check_environment()
    assert (server.mode(), server.kernel(), server._staging_bytes()) == ("direct", "torch", 1 << 20)
