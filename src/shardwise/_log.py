"""The ``shardwise`` logger: rank 0 only by default, WARNING and above by default.

``SHARDWISE_LOG=info`` (or ``debug``, ``warning``, ...) sets the level; ``info`` shows the
units and layout chosen by ``shard`` and each step's communication volume.
``SHARDWISE_LOG_ALL_RANKS=1`` lets every rank speak, each line prefixed with its rank.
Library code never prints; applications configure handlers as usual (a handler on
stderr is added only when the application has configured none).
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

logger = logging.getLogger("shardwise")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _RankFilter(logging.Filter):
    """Rank 0 only, unless ``SHARDWISE_LOG_ALL_RANKS=1``; adds ``record.rank``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank = rank  # for the formatter
        return rank == 0 or os.environ.get("SHARDWISE_LOG_ALL_RANKS") == "1"


def _configure() -> None:
    level = os.environ.get("SHARDWISE_LOG", "warning").upper()
    logger.setLevel(getattr(logging, level, logging.WARNING))
    logger.addFilter(_RankFilter())
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[shardwise rank %(rank)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_configure()
