"""The optimizer step over disk-offloaded state: one unit at a time.

Note [stepping unit by unit]
Memory stays bounded only if one unit's master shards, gradients and optimizer state are
resident at a time (Note [the disk tier]). ``torch.optim`` optimizers step every
parameter in one call, so before the step runs (a global step pre-hook) the step is run
here once per unit, with each parameter group narrowed to that unit's parameters, while
the next unit's pages are read ahead. After each call the state the optimizer created is
moved into the unit's files and the unit's pages are dropped. The optimizer's own call
then finds no gradients (they are set aside until its post-hook puts them back), so it
changes nothing, and its hooks, LR-scheduler counters and return value behave as usual
(a closure is evaluated once, before the units step, and its loss returned).

Narrowing is exact only for optimizers that update each parameter from its own gradient
and state: the ``torch.optim`` classes in :data:`PER_PARAMETER`. Any other is refused at
its first step by name (``optimizer="cpu"`` steps any optimizer in one call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...._registry import PARAM, SET_ASIDE_GRADS, attach_to, attached, detach_from
from ....errors import ShardwiseError
from ..alloc import trim
from .storage import OPTIMIZER_TIERS_USED, GroupStorage


def _storage(p: torch.Tensor) -> tuple[Any, GroupStorage | None]:
    """The sharded parameter behind ``p`` (engine/groups/flat.py's ShardedParam, found through
    the registry: this package sits below the groups that use it) and its group's
    offloaded storage, or ``None``."""
    sp = attached(p, PARAM)
    storage = getattr(sp.group, "storage", None) if sp is not None else None
    return sp, storage if isinstance(storage, GroupStorage) else None

# torch.optim optimizers whose update of a parameter reads only that parameter, its
# gradient, its own state and the group's hyperparameters.
PER_PARAMETER = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD",
                           "NAdam", "RAdam", "RMSprop", "Rprop"})


def _buckets(optimizer: torch.optim.Optimizer
             ) -> tuple[list[tuple[list[GroupStorage], set[int]]], set[int]]:
    """The optimizer's parameters by disk-offloaded unit, in unit order, and the rest."""
    by_unit: dict[tuple[int, int], tuple[list[GroupStorage], set[int]]] = {}
    rest: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            sp, store = _storage(p)
            unit = sp.unit if sp is not None else None
            if store is None or store.placement.optimizer != "disk" or unit is None:
                rest.add(id(p))
                continue
            key = (unit.model.number, unit.index)
            if key not in by_unit:
                stores = [s for g in unit.groups
                          if isinstance(s := getattr(g, "storage", None), GroupStorage)]
                by_unit[key] = (stores, set())
            by_unit[key][1].add(id(p))
    return [by_unit[k] for k in sorted(by_unit)], rest


def _inner_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step without torch's hook wrapper (which would call this module
    again, and the user's hooks once per unit)."""
    outer = type(optimizer).step
    inner = getattr(outer, "__wrapped__", None)
    if not getattr(outer, "hooked", False) or inner is None:
        raise ShardwiseError(f"{type(optimizer).__name__}.step is not torch's hooked step, "
                             f"so shardwise cannot step its disk-offloaded state unit by "
                             f"unit; use Offload(optimizer='cpu')")
    return inner


def _refuse(optimizer: torch.optim.Optimizer) -> None:
    cls = type(optimizer)
    if cls.__name__ not in PER_PARAMETER or not cls.__module__.startswith("torch.optim"):
        raise ShardwiseError(
            f"{cls.__module__}.{cls.__name__} cannot step disk-offloaded state: shardwise "
            f"steps it one unit at a time to keep memory bounded, which gives the same "
            f"result only for optimizers that update each parameter from its own gradient "
            f"and state (torch.optim's {', '.join(sorted(PER_PARAMETER))}). Nothing was "
            f"updated. Use Offload(optimizer='cpu'), which steps any optimizer")
    if optimizer._optimizer_step_pre_hooks:
        raise ShardwiseError(
            f"{cls.__name__} has step pre-hooks (register_step_pre_hook), which would run "
            f"after shardwise stepped its disk-offloaded state unit by unit. Nothing was "
            f"updated. Do their work before optimizer.step(), or use "
            f"Offload(optimizer='cpu')")


def step_by_unit(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
                 ) -> tuple[tuple, dict] | None:
    """Note [stepping unit by unit]: run the step, and return the arguments that make
    the optimizer's own call change nothing (``None``: no disk-offloaded state here)."""
    if "disk" not in OPTIMIZER_TIERS_USED:
        return None
    buckets, rest = _buckets(optimizer)
    if not buckets:
        return None
    _refuse(optimizer)
    inner = _inner_step(optimizer)
    # ``args`` are the step's own: the optimizer, then the closure if passed by position.
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    saved = [g["params"] for g in optimizer.param_groups]
    plan: list[tuple[list[GroupStorage], set[int]]] = ([([], rest)] if rest else []) + buckets
    try:
        for i, (stores, members) in enumerate(plan):
            if i + 1 < len(plan):
                for s in plan[i + 1][0]:
                    s.prefetch()
            for s in stores:  # Note [tier files changed from outside] in disk.py
                s.check_files()
            for group, params in zip(optimizer.param_groups, saved):
                group["params"] = [p for p in params if id(p) in members]
            inner(optimizer)
            stepped = [p for ps in saved for p in ps if id(p) in members]
            moved = _adopt(optimizer, stepped)
            _count(optimizer, stepped)
            for s in stores:
                s.release()
            if moved:
                # The state just made in memory, freed, would otherwise stay in glibc's
                # heap until the end of the step (Note [a fixed mmap threshold]).
                trim()
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        # The step's temporaries, freed, stay in glibc's heap otherwise (Note [a fixed
        # mmap threshold]; what they came to: BENCHMARKS.md, "Offload").
        trim()
    stash = {}
    for params in saved:
        for p in params:
            if p.grad is not None:
                stash[p] = p.grad
                p.grad = None
    attach_to(optimizer, SET_ASIDE_GRADS, stash)
    return (optimizer,), {"closure": (lambda: loss)} if closure is not None else {}


def after_step(optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> None:
    """After the optimizer's own call: give the parameters their gradients back (after a
    unit-by-unit step, whose traffic was counted then), or count what the step of state
    in host memory read and wrote (Note [bytes moved])."""
    stash = attached(optimizer, SET_ASIDE_GRADS)
    if stash is None:
        if "cpu" not in OPTIMIZER_TIERS_USED:
            return
        _count(optimizer, [p for g in optimizer.param_groups for p in g["params"]],
               tier="cpu")
        return
    detach_from(optimizer, SET_ASIDE_GRADS)
    for p, grad in stash.items():
        p.grad = grad


def _count(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
           tier: str | None = None) -> None:
    for p in params:
        sp, store = _storage(p)
        if p.grad is None or store is None:
            continue
        if tier is None or store.placement.optimizer == tier:
            store.count_step(sp, optimizer.state.get(p, {}))


def _adopt(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Move the state the step made for ``params`` into their units' files; how many
    tensors moved."""
    moved = 0
    for p in params:
        sp, store = _storage(p)
        st = optimizer.state.get(p)
        if store is None or not st:
            continue
        for k, v in list(st.items()):
            if isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
                st[k] = store.adopt_state(sp, k, v)
                moved += st[k] is not v
    return moved
