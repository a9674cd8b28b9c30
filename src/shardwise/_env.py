"""Environment switches, read at each use so that no process-wide state is kept.

Each variable has one reader here; what a value means is decided in one place.
"""

from __future__ import annotations

import os


def check_setting() -> bool | None:
    """``SHARDWISE_CHECK``: True for any value but ``0`` (checks on everywhere), False for
    ``0`` (off everywhere), None when unset or empty (each check's default)."""
    value = os.environ.get("SHARDWISE_CHECK", "")
    return None if value == "" else value != "0"


def checks_enabled() -> bool:
    """Whether the consistency checks after ``shard``, ``load_pretrained`` and
    ``gathered(modifier_rank=...)`` run: only when ``SHARDWISE_CHECK`` asks for them."""
    return check_setting() is True


def peer_timeout() -> float:
    """``SHARDWISE_PEER_TIMEOUT``: seconds a peer may stay elsewhere before a waiting
    rank raises (Note [peer watch] in comm/peers.py); 30 by default, 0 turns the watch off."""
    try:
        return max(0.0, float(os.environ.get("SHARDWISE_PEER_TIMEOUT", "30")))
    except ValueError:
        return 30.0
