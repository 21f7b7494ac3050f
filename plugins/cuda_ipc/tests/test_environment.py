"""The KVXFER_CUDA_IPC_* variables are checked, not taken for their default when misspelt. Runs
without a GPU: the checks read only the environment (CudaIpcServerTransport.start calls
check_environment before it touches CUDA)."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from kvxfer import ConfigError
from kvxfer_cuda_ipc import server, transport

_PR_GET_TIMERSLACK = 30


@pytest.mark.parametrize(("name", "value"), [
    ("KVXFER_CUDA_IPC_MODE", "Direct"), ("KVXFER_CUDA_IPC_MODE", "zero-copy"),
    ("KVXFER_CUDA_IPC_KERNEL", "TORCH"), ("KVXFER_CUDA_IPC_KERNEL", "cuda"),
    ("KVXFER_CUDA_IPC_STAGING_MIB", "0"), ("KVXFER_CUDA_IPC_STAGING_MIB", "-5"),
    ("KVXFER_CUDA_IPC_STAGING_MIB", "1e3"), ("KVXFER_CUDA_IPC_STAGING_MIB", str(1 << 40)),
    ("KVXFER_CUDA_IPC_STAGING_MIB", "1_6"), ("KVXFER_CUDA_IPC_STAGING_MIB", "\u0664"),
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


@pytest.mark.skipif(sys.platform != "linux", reason="timer slack is a Linux setting")
def test_the_thread_that_polls_done_events_gets_a_fine_timer_and_no_other_does() -> None:
    """finish_retrieve's polls sleep 20 us: with Linux's default 50 us of timer slack they ran
    ~70 us apart. The polling thread asks for POLL_SLACK_NS; other threads keep theirs."""
    libc = ctypes.CDLL(None)
    seen: dict[str, int] = {}

    def poller() -> None:
        seen["before"] = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
        transport.fine_timer()
        transport.fine_timer()  # once per thread: the second call changes nothing
        seen["after"] = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)

    t = threading.Thread(target=poller)
    t.start()
    t.join()
    assert seen["before"] > transport.POLL_SLACK_NS
    assert seen["after"] == transport.POLL_SLACK_NS
    assert libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) == seen["before"]  # this thread's is its own
