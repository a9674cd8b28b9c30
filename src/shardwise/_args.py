"""Argument checks shared by the public functions: a ``ShardwiseError`` that names the
argument and what it accepts, never a bare exception from deep inside."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .errors import ShardwiseError


def require_module(value: Any, function: str, argument: str = "module") -> None:
    """Raise unless ``value`` is an ``nn.Module``.

    Raises:
        ShardwiseError: ``function: argument must be a module (an nn.Module), got ...``.
    """
    if not isinstance(value, nn.Module):
        raise ShardwiseError(f"{function}: {argument} must be a module (an nn.Module), got "
                             f"{shown(value)}")


def shown(value: Any) -> str:
    """``value`` for a message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
