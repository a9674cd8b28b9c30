"""The ``shardwise`` logger: rank 0 only by default, WARNING and above by default.

``SHARDWISE_LOG=info`` (or ``debug``, ``warning``, ...) sets the level; ``info`` shows the
units and layout chosen by ``shard`` and each step's communication volume.
``SHARDWISE_LOG_ALL_RANKS=1`` lets every rank speak, each line prefixed with its rank.
Library code never prints; applications configure handlers as usual (a handler on
stderr is added only when the application has configured none). Optional libraries
are imported without the log lines their imports emit (:func:`quiet_imports`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import torch
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


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Import optional libraries (torchao, transformers, which imports torchao) without
    the log lines and warnings their imports emit, which concern no shardwise user: a
    command's output begins with its own lines."""
    # torchao logs each CUDA library it fails to load, and torch's pytree logs a
    # deprecation for an enum torchao registers: neither concerns the user.
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    skip = "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"
    forced = skip not in os.environ and not torch.cuda.is_available()
    if forced:
        os.environ[skip] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if forced:
            del os.environ[skip]


_configure()
