"""$KVXFER_CPU_GATHER_THREADS is checked: an integer in [1, MAX_THREADS], else a ConfigError
naming it (a registration through cpu_gather then fails with that message:
test_conformance.py::TestCpuGather::test_a_bad_thread_count_is_refused_at_registration)."""

from __future__ import annotations

import pytest
from kvxfer_cpu_gather.transport import MAX_THREADS, THREADS_ENV, copy_threads

from kvxfer import ConfigError


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", str(MAX_THREADS + 1), str(1 << 40)])
def test_a_bad_thread_count_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ConfigError, match=THREADS_ENV):
        copy_threads()


def test_good_thread_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("1", "4", str(MAX_THREADS)):
        monkeypatch.setenv(THREADS_ENV, value)
        assert copy_threads() == int(value)

