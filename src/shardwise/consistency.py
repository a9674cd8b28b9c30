"""Consistency checks: every replicated tensor identical on every rank, or a loud error.

``check_consistency`` compares a hash of the raw bytes of every buffer and every
unsharded parameter across ranks. ``SHARDWISE_CHECK=1`` runs it after ``shard``,
``load_pretrained`` and a ``gathered(..., modifier_rank=...)`` block (``maybe_check``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn as nn

from ._env import checks_enabled
from ._order_check import announce
from ._registry import sharded_param
from .buffers import comm_for, named_buffers
from .errors import DivergenceError


def tensor_digest(t: torch.Tensor) -> str:
    """A hash of a tensor's raw bytes: any difference, even in one bit, changes it."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    raw = data.view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


def _replicated(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor that should be identical on all ranks: buffers, unsharded parameters."""
    out = [(n, p) for n, p in module.named_parameters() if sharded_param(p) is None]
    return out + named_buffers(module)


def check_consistency(module: nn.Module, group=None) -> None:
    """Check that every buffer and replicated parameter is bit-identical on every rank.

    Compares a hash of each tensor's raw bytes, so any difference is caught.

    Args:
        module: any module, sharded or not (for a sharded one, its buffers).
        group: process group; default the model's group (sharded) or the world.

    Raises:
        DivergenceError: on every rank, naming each differing tensor, its dtype and shape,
            and which ranks hold which version.
        ShardwiseError: when torch.distributed is not initialised.

    Example:
        >>> sw.check_consistency(model)   # after training steps, before saving
    """
    comm = comm_for(module, group)
    announce(comm, "check_consistency")
    mine = {n: (str(t.dtype).replace("torch.", ""), tuple(t.shape), tensor_digest(t))
            for n, t in _replicated(module)}
    everyone = comm.all_gather_object(mine)
    names = sorted(set().union(*[set(d) for d in everyone]))
    problems = []
    for name in names:
        versions: dict[Any, list[int]] = {}
        for rank, d in enumerate(everyone):
            versions.setdefault(d.get(name), []).append(rank)
        if len(versions) > 1:
            parts = []
            for k, (v, ranks) in enumerate(versions.items()):
                what = "missing" if v is None else f"{v[0]} {list(v[1])} version {chr(65 + k)}"
                parts.append(f"ranks {ranks}: {what}")
            problems.append(f"  {name}: " + "; ".join(parts))
    if problems:
        raise DivergenceError(f"{len(problems)} replicated tensor(s) differ across the "
                              f"{comm.world_size} ranks:\n" + "\n".join(problems))


def maybe_check(module: nn.Module) -> None:
    """Run :func:`check_consistency` when the environment sets ``SHARDWISE_CHECK=1``.

    Called after ``shard``, after ``load_pretrained`` and after a ``gathered`` block with
    a modifier exits (``save_checkpoint`` checks always). Read at each call, so it is no
    process-wide switch that a model could set for another.
    """
    if checks_enabled():
        check_consistency(module)
