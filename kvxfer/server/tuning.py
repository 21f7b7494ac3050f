"""Bounds of the server's tuning options (``--busy-poll-us``, ``--warm-us``). A module of its own,
importing nothing, as the CLI's parser reads them: ``kvxfer --help`` must not load the server."""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_BUSY_POLL_S", "DEFAULT_WARM_S", "MIN_WARM_S", "MAX_WARM_S"]

#: Longest ``busy_poll_s``: a loop that spins longer than a second after a request is a loop
#: that never sleeps.
MAX_BUSY_POLL_S: Final = 1.0
#: Default ``warm_s`` (off: measured to keep single steps warm, not shown to shorten a whole
#: request; docs/performance.md, "Keeping the steps warm"), and the shortest and longest period
#: other than 0: shorter spends a CPU on warmth; a few milliseconds of sleep are what make the
#: steps run cold, so a longer period warms nothing.
DEFAULT_WARM_S: Final = 0.0
MIN_WARM_S: Final = 100e-6
MAX_WARM_S: Final = 5e-3
