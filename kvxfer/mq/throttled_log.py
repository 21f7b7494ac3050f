"""Lines a peer can cause at will, logged at most once per second per kind.

A storm of refused connections or malformed requests must not flood the server's log: each kind
of line is written at once, then at most once per :data:`INTERVAL_S`, with the count of the
lines left out since the last one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final

__all__ = ["ThrottledLog"]

INTERVAL_S: Final = 1.0


class ThrottledLog:
    """``warning(kind, line)``: log ``line`` unless a line of ``kind`` was logged less than
    :data:`INTERVAL_S` ago (any thread)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._lock = threading.Lock()
        #: kind -> (lines asked for, lines logged, when the next may be logged)
        self._kinds: dict[str, tuple[int, int, float]] = {}

    def warning(self, kind: str, line: str) -> None:
        self.log(logging.WARNING, kind, line)

    def log(self, level: int, kind: str, line: str) -> None:
        """As :meth:`warning`, at ``level``."""
        now = time.monotonic()
        with self._lock:
            count, logged, at = self._kinds.get(kind, (0, 0, 0.0))
            count += 1
            more = -1
            if now >= at:
                more = count - logged - 1
                logged, at = count, now + INTERVAL_S
            self._kinds[kind] = (count, logged, at)
        if more >= 0:
            self._log.log(level, "%s%s", line, f" (and {more} more since the last such line)" if more else "")
