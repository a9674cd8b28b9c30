"""What ``optimizer.step()`` runs on a sharded model: the step hooks, in one place.

Note [the optimizer step]
An optimizer over a sharded model is the user's own torch optimizer, built from
``model.parameters()``: it holds the DTensor shards, and each rank updates its rows only.
shardwise never wraps it. By the time ``optimizer.step()`` runs, each shard's ``.grad``
already holds this rank's rows of the averaged gradient: the backward reduce-scattered
them (engine/groups/reduce.py; exactly in the reproducible mode, engine/groups/exact_reduction.py),
and ``sw.clip_grad_norm_`` (grads.py) may have rescaled them. What shardwise adds to the step
itself runs in two process-wide hooks torch calls around every optimizer's ``step``
(``register_optimizer_step_pre_hook`` and ``..._post_hook``), which the first ``sw.shard``
of a process installs (:func:`install_step_hooks`, from engine/build.py). For an optimizer
holding no shards each does nothing. A placement whose tiers need a part of the step
(``Placement.optimizer_step`` in engine/groups/parts.py) has it added by the build of the
first model placed so; the hooks ask each part added, and name no tier. In order:

1. before the step (:func:`_before_step`):
   a. the misuse checks, which raise before anything changes (``check_step`` in
      engine/entry_points/guards.py: Adafactor over shards, full parameters taken while gathered,
      plain parameters nothing synchronises; in the reproducible mode, a warning for
      gradients rescaled other than by ``sw.clip_grad_norm_``);
   b. a placement's part of the step may run the step itself and give the optimizer's
      own call arguments that change nothing (disk-offloaded state, stepped one unit at
      a time: Note [stepping unit by unit] in engine/groups/offload/storage.py);
   c. otherwise torch's per-element optimizers are handed the shards' local tensors
      instead of the DTensors (Note [plain step] in engine/entry_points/plain_step.py);
2. the optimizer's own ``step``: its arithmetic, on this rank's rows;
3. after the step (:func:`_after_step`): the plain step's swap undone, then each
   placement's part (the gradients set aside by a unit-by-unit step given back, the host
   tier's traffic counted).

The updated rows reach the modules at the next forward, whose gathers read the shards.
Each optimizer that holds shards also carries ``state_dict`` and ``load_state_dict``
hooks (Note [optimizers meet shards] in engine/entry_points/state_dict.py).

Note [what shardwise patches in torch]
Everything shardwise changes in torch itself, process-wide: each is installed by the
first ``sw.shard`` of a process, never removed, and does nothing for objects that hold
no shards.
- The global optimizer step pre- and post-hooks (this module, Note [the optimizer step]).
- ``torch.optim.Optimizer.add_param_group``, wrapped so that each optimizer holding shards
  gets its ``state_dict`` hooks (Note [optimizers meet shards] in
  engine/entry_points/state_dict.py). It cannot wait for the first step: a full optimizer state
  dict loaded before any step must already be cut to this rank's rows.
- ``torch.nn.parallel.DistributedDataParallel.__init__``, refusing a wrapper around a
  sharded submodule (Note [torch classes that meet shards] in engine/entry_points/guards.py).
The rest is per object: the sharded model's own methods and hooks (each module's
``zero_grad`` and each optimizer's holding shards are shadowed on the instance: Note
[zero_grad reaches held gradients] in engine/entry_points/zero_grad.py), the retired class of
an original parameter replaced by its shard (``guards.retire``), and, only while a
``sw.sharded_init`` block runs, a module registration hook (engine/sharded_init.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..._registry import mark_synchronised
from ...errors import ShardwiseError
from ..groups.parts import OptimizerStep, Placement
from ..iteration.unit import sharded_param
from . import plain_step
from .guards import check_step

_installed = False
# The placements' parts of the step (Note [the optimizer step]): one per kind of
# placement a model of this process was built with, in the order first met. Builds run
# on the main thread (``sw.shard`` is a collective), so the check below needs no lock.
_placement_steps: list[OptimizerStep] = []


def install_step_hooks(placement: Placement | None = None) -> None:
    """Install the step hooks of Note [the optimizer step], once per process, and add
    ``placement``'s part of the step, once per kind."""
    global _installed
    part = placement.optimizer_step() if placement is not None else None
    if part is not None and all(part is not p for p in _placement_steps):
        _placement_steps.append(part)
    if _installed:
        return
    _installed = True
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
                 ) -> tuple[tuple, dict] | None:
    """Step 1 of Note [the optimizer step]; the arguments the optimizer's own call gets
    instead of its own, or None."""
    check_step(optimizer)
    for part in _placement_steps:
        changed = part.before(optimizer, args, kwargs)
        if changed is not None:
            return changed
    plain_step.enter(optimizer, args, kwargs)  # Note [plain step]
    return None


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step 3 of Note [the optimizer step]."""
    plain_step.leave(optimizer)
    for part in _placement_steps:
        part.after(optimizer, args, kwargs)


# Declaring parameters deliberately per rank: what lets the step's refusal of Note
# [parameters nothing synchronises] (engine/entry_points/guards.py) pass them.
def per_rank(module_or_params: nn.Module | torch.Tensor | Any) -> Any:
    """Declare parameters deliberately trained per rank, with gradients nothing averages.

    An optimizer that steps shards of a sharded model over several ranks refuses to step
    other trainable parameters that nothing synchronises (a plain ``model.head`` beside
    ``sw.shard(model.encoder)`` would drift apart across ranks, silently). Parameters
    wrapped in ``DistributedDataParallel`` or sharded by FSDP2 count as synchronised.
    Declare the rare deliberate exception with this function; better, shard the root.

    Args:
        module_or_params: a module (all its parameters), a parameter, or an iterable of
            parameters.

    Returns:
        Its argument, so that it can wrap a construction.

    Raises:
        ShardwiseError: for a shard of a sharded model, which is synchronised already,
            or an argument that holds no parameters.

    Example:
        >>> model.encoder = sw.shard(model.encoder)
        >>> sw.per_rank(model.rank_bias)   # each rank's own, on purpose
    """
    params: list[torch.Tensor]
    if isinstance(module_or_params, nn.Module):
        params = list(module_or_params.parameters())
    elif isinstance(module_or_params, torch.Tensor):
        params = [module_or_params]
    else:
        try:
            params = list(module_or_params)
        except TypeError:
            params = []
        if not all(isinstance(p, torch.Tensor) for p in params):
            params = []
    if not params:
        raise ShardwiseError(f"sw.per_rank takes a module, a parameter or an iterable of "
                             f"parameters, got {type(module_or_params).__name__} without "
                             f"parameters")
    if any(sharded_param(p) is not None for p in params):
        raise ShardwiseError("sw.per_rank: a sharded model's parameters are synchronised by "
                             "shardwise; declare only parameters outside it")
    for p in params:
        mark_synchronised(p, "sw.per_rank")
    return module_or_params
