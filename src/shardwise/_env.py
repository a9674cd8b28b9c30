"""Environment switches, read at each use so that no process-wide state is kept."""

from __future__ import annotations

import os


def checks_enabled() -> bool:
    """Whether ``SHARDWISE_CHECK=1`` is set (read at each call: no process-wide switch)."""
    return os.environ.get("SHARDWISE_CHECK", "0") not in ("", "0")
