"""Exceptions raised by shardwise. All derive from :class:`ShardwiseError`."""

from __future__ import annotations


class ShardwiseError(RuntimeError):
    """Base class of every error shardwise raises on purpose."""


class DivergenceError(ShardwiseError):
    """Replicated state (a buffer or an unsharded parameter) differs across ranks."""


class ReadOnlyGatherError(ShardwiseError):
    """A tensor was written inside a read-only ``sw.gathered(...)`` block."""


class CollectiveError(ShardwiseError):
    """A collective failed or timed out; the message names it and the rank.

    Raised when a peer rank died, or when ranks diverged so that no peer joined the
    collective within the process group's timeout.
    """
