"""Default addresses: the server's ipc:// socket lives in a private (0700) directory."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_url", "private_runtime_dir"]


def private_runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvxfer`` when set, else ``/tmp/kvxfer-<uid>`` (created 0700 by the server)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "kvxfer"
    return Path("/tmp") / f"kvxfer-{os.getuid()}"


def default_url() -> str:
    """``$KVXFER_URL``, or ``ipc://<private runtime dir>/kvxfer.sock``."""
    return os.environ.get("KVXFER_URL") or f"ipc://{private_runtime_dir() / 'kvxfer.sock'}"
