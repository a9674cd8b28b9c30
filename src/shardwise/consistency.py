"""Consistency checks: every replicated tensor identical on every rank, or a loud error.

``check_consistency`` compares a hash of the raw bytes of every buffer and every
unsharded parameter across ranks, and, under hybrid sharding (Note [hybrid sharding] in
comm/mesh.py), of every shard across the replicas that hold it. ``SHARDWISE_CHECK=1`` runs
it after ``shard``, ``load_pretrained`` and a ``gathered(..., modifier_rank=...)`` block
(``maybe_check``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._env import checks_enabled
from .comm.order_check import operation
from .engine.iteration.buffers import comm_for, named_buffers
from .engine.iteration.state import model_state
from .engine.iteration.unit import sharded_param
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


def _replica_shards(module: nn.Module) -> tuple[int, int, dict[str, str]]:
    """Under hybrid sharding: (this rank's replica, its shard rank, a hash of its rows of
    each sharded parameter); replicas must hold the same rows bit for bit."""
    state = model_state(module)
    if state is None or state.topology.replicate is None:
        return 0, 0, {}
    topo = state.topology
    # Each parameter's part: its rows, or a tensor subclass's bytes (Note [one group type]).
    rows = {p.fqns[0]: tensor_digest(p.local)
            for u in state.units for g in u.groups for p in g.params}
    return topo.replica_index, topo.shard.rank, rows


def _replica_differences(everyone: list[tuple[int, int, dict[str, str]]]) -> list[str]:
    """One line per parameter whose rows differ between replicas of the same shard."""
    problems = []
    by_shard: dict[int, list[tuple[int, int, dict[str, str]]]] = {}
    for rank, (replica, shard, rows) in enumerate(everyone):
        by_shard.setdefault(shard, []).append((rank, replica, rows))
    for shard, holders in sorted(by_shard.items()):
        for name in sorted(holders[0][2]):
            seen: dict[str | None, list[str]] = {}
            for rank, replica, rows in holders:
                seen.setdefault(rows.get(name), []).append(f"replica {replica} (rank {rank})")
            if len(seen) > 1:
                parts = [f"{', '.join(who)}: version {chr(65 + k)}"
                         for k, who in enumerate(seen.values())]
                problems.append(f"  {name}, rows of shard {shard}: " + "; ".join(parts))
    return problems


def _optimizer_facts(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What must agree across ranks about an optimizer: how many steps each parameter
    has taken (the range, a hash of them all) and every hyperparameter of every group."""
    steps = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            s = optimizer.state.get(p, {}).get("step")
            steps.append(None if s is None else float(s.to_local() if isinstance(
                s, DTensor) else s) if isinstance(s, torch.Tensor) else s)
    taken = [s for s in steps if s is not None]
    digest = hashlib.blake2b(repr(steps).encode(), digest_size=8).hexdigest()
    facts: dict[str, Any] = {
        "optimizer step count": (f"{min(taken):g}" if taken and min(taken) == max(taken)
                                 else f"{min(taken):g}..{max(taken):g}" if taken else "none",
                                 digest)}
    for i, g in enumerate(optimizer.param_groups):
        for k, v in g.items():
            if k != "params":
                value = v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                facts[f"optimizer.param_groups[{i}].{k}"] = (repr(value), "")
    return facts


@operation("check_consistency", lambda module, group, optimizer: (
    comm_for(module, group),
    "check_consistency" if optimizer is None else "check_consistency(optimizer=...)", None))
def check_consistency(module: nn.Module, group=None,
                      optimizer: torch.optim.Optimizer | None = None) -> None:
    """Check that every buffer and replicated parameter is bit-identical on every rank,
    under hybrid sharding that every replica holds the same rows of every parameter,
    and, given ``optimizer``, that every rank's optimizer has taken as many steps with
    the same hyperparameters.

    Compares a hash of each tensor's raw bytes, so any difference is caught. A rank that
    skipped ``optimizer.step()`` holds the same kind of sharded state as its peers; only
    its step count and its rows' values differ, so pass the optimizer to catch it.

    Args:
        module: any module, sharded or not (for a sharded one, its buffers).
        group: process group; default the model's group (sharded) or the world.
        optimizer: optional; its per-parameter step counts and every group's
            hyperparameters are compared too.

    Raises:
        DivergenceError: on every rank, naming each differing tensor, its dtype and shape,
            and which ranks hold which version; or the optimizer's step counts or
            hyperparameters that differ, with each rank's value.
        ShardwiseError: when torch.distributed is not initialised.

    Example:
        >>> sw.check_consistency(model, optimizer=opt)   # after a step, before saving
    """
    comm = comm_for(module, group)
    mine = {n: (str(t.dtype).replace("torch.", ""), tuple(t.shape), tensor_digest(t))
            for n, t in _replicated(module)}
    facts = _optimizer_facts(optimizer) if optimizer is not None else {}
    everyone = comm.all_gather_object((mine, facts, _replica_shards(module)))
    problems = _differences([d for d, _, _ in everyone], lambda v: f"{v[0]} {list(v[1])}")
    problems += _differences([f for _, f, _ in everyone], lambda v: v[0], versions=False)
    if any(rows for _, _, (_, _, rows) in everyone):
        problems += _replica_differences([r for _, _, r in everyone])
    if problems:
        raise DivergenceError(f"{len(problems)} replicated value(s) differ across the "
                              f"{comm.world_size} ranks:\n" + "\n".join(problems))


def _differences(everyone: list[dict[str, Any]], show, versions: bool = True) -> list[str]:
    """One line per name whose value is not the same on every rank."""
    problems = []
    for name in sorted(set().union(*[set(d) for d in everyone])):
        seen: dict[Any, list[int]] = {}
        for rank, d in enumerate(everyone):
            seen.setdefault(d.get(name), []).append(rank)
        if len(seen) > 1:
            parts = []
            for k, (v, ranks) in enumerate(seen.items()):
                what = "missing" if v is None else show(v) + (f" version {chr(65 + k)}"
                                                               if versions else "")
                parts.append(f"ranks {ranks}: {what}")
            problems.append(f"  {name}: " + "; ".join(parts))
    return problems


def maybe_check(module: nn.Module) -> None:
    """Run :func:`check_consistency` when the environment sets ``SHARDWISE_CHECK=1``.

    Called after ``shard``, after ``load_pretrained`` and after a ``gathered`` block with
    a modifier exits (``save_checkpoint`` checks always). Read at each call, so it is no
    process-wide switch that a model could set for another.
    """
    if checks_enabled():
        check_consistency(module)
