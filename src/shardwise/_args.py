"""Argument checks shared by the public functions: a ``ShardwiseError`` that names the
argument and what it accepts, never a bare exception from deep inside."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
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


def require_optimizer(value: Any, function: str) -> None:
    """Raise unless ``value`` is ``None`` or a ``torch.optim.Optimizer``."""
    if value is not None and not isinstance(value, torch.optim.Optimizer):
        raise ShardwiseError(f"{function}: optimizer must be a torch.optim.Optimizer (built "
                             f"over the module's parameters) or None, got {shown(value)}")


def require_group(value: Any, function: str) -> None:
    """Raise unless ``value`` is ``None`` (the default group) or a process group."""
    if value is not None and not isinstance(value, dist.ProcessGroup):
        raise ShardwiseError(f"{function}: group must be a torch.distributed process group "
                             f"(dist.new_group(...)) or None, got {shown(value)}")


def require_rank(value: Any, function: str, argument: str = "src_rank") -> None:
    """Raise unless ``value`` is an int (its range is checked where the group is known)."""
    if type(value) is not int:
        raise ShardwiseError(f"{function}: {argument}={value!r}: expected an int, a rank of "
                             f"the group")


def require_bool(value: Any, function: str, argument: str) -> None:
    """Raise unless ``value`` is ``True`` or ``False``: a string such as ``"no"`` is
    truthy, and would silently mean the opposite of what it says.

    Raises:
        ShardwiseError: ``function: argument must be True or False, got ...``.
    """
    if not isinstance(value, bool):
        raise ShardwiseError(f"{function}: {argument} must be True or False, got "
                             f"{shown(value)}; pass {argument}=True or {argument}=False")


def shown(value: Any) -> str:
    """``value`` for a message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def some_names(names: list[Any]) -> str:
    """The first three of ``names`` for an error message, with ``...`` if there are more."""
    return ", ".join(map(str, names[:3])) + (", ..." if len(names) > 3 else "")
