"""Integrations with the tools people train with; each imports its library lazily.

- :mod:`shardwise.integrations.accelerate`: ``ShardwiseAccelerator``, an ``accelerate``
  ``Accelerator`` that shards models instead of wrapping them in DDP.
- :mod:`shardwise.integrations.transformers`: ``ShardwiseTrainer``, a Hugging Face
  ``Trainer`` built on it, also a mixin of TRL's trainers
  (``class X(DPOTrainer, ShardwiseTrainer)``; what TRL needs besides is in
  :mod:`shardwise.integrations.trl`).
- :mod:`shardwise.integrations.lightning`: ``ShardwiseStrategy``, a Lightning strategy
  that shards the ``LightningModule``; importing it registers ``strategy="shardwise"``.

The names are importable from here too (``from shardwise.integrations import
ShardwiseStrategy``); each import loads only its own library, on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ShardwiseAccelerator": "accelerate",
    "ShardwiseTrainer": "transformers",
    "ShardwiseStrategy": "lightning",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    # PEP 562: `import shardwise.integrations` must not import accelerate, transformers
    # or lightning; the attribute's own module is imported when it is first asked for.
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
