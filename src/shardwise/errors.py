"""Exceptions raised by shardwise. All derive from :class:`ShardwiseError`."""

from __future__ import annotations


class ShardwiseError(RuntimeError):
    """Base class of every error shardwise raises on purpose."""


class DivergenceError(ShardwiseError):
    """Replicated state (a buffer or an unsharded parameter) differs across ranks."""


class ReadOnlyGatherError(ShardwiseError):
    """A tensor was written inside a read-only ``sw.gathered(...)`` block."""
