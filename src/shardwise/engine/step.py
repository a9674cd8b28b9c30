"""What ``optimizer.step()`` runs on a sharded model: the step hooks, in one place.

Note [the optimizer step]
An optimizer over a sharded model is the user's own torch optimizer, built from
``model.parameters()``: it holds the DTensor shards, and each rank updates its rows only.
shardwise never wraps it. By the time ``optimizer.step()`` runs, each shard's ``.grad``
already holds this rank's rows of the averaged gradient: the backward reduce-scattered
them (engine/reduce.py; exactly in the reproducible mode, engine/exact_reduction.py), and
``sw.clip_grad_norm_`` (grads.py) may have rescaled them. What shardwise adds to the step
itself runs in two process-wide hooks torch calls around every optimizer's ``step``
(``register_optimizer_step_pre_hook`` and ``..._post_hook``), which the first ``sw.shard``
of a process installs (:func:`install_step_hooks`, from engine/build.py). For an optimizer
holding no shards each does nothing. In order:

1. before the step (:func:`_before_step`):
   a. the misuse checks, which raise before anything changes (``check_step`` in
      engine/guards.py: Adafactor over shards, full parameters taken while gathered,
      plain parameters nothing synchronises; in the reproducible mode, a warning for
      gradients rescaled other than by ``sw.clip_grad_norm_``);
   b. disk-offloaded state is stepped here, one unit at a time, and the optimizer's own
      call is given arguments that change nothing (Note [stepping unit by unit] in
      engine/offload/step.py);
   c. otherwise torch's per-element optimizers are handed the shards' local tensors
      instead of the DTensors (Note [plain step] in engine/plain_step.py);
2. the optimizer's own ``step``: its arithmetic, on this rank's rows;
3. after the step (:func:`_after_step`): the plain step's swap undone, the gradients set
   aside by a unit-by-unit step given back, the host tier's traffic counted.

The updated rows reach the modules at the next forward, whose gathers read the shards.
Each optimizer that holds shards also carries ``state_dict`` and ``load_state_dict``
hooks (Note [optimizers meet shards] in engine/state_dict_hooks.py).

Note [what shardwise patches in torch]
Everything shardwise changes in torch itself, process-wide: each is installed by the
first ``sw.shard`` of a process, never removed, and does nothing for objects that hold
no shards.
- The global optimizer step pre- and post-hooks (this module, Note [the optimizer step]).
- ``torch.optim.Optimizer.add_param_group``, wrapped so that each optimizer holding shards
  gets its ``state_dict`` hooks (Note [optimizers meet shards] in
  engine/state_dict_hooks.py). It cannot wait for the first step: a full optimizer state
  dict loaded before any step must already be cut to this rank's rows.
- ``torch.nn.parallel.DistributedDataParallel.__init__``, refusing a wrapper around a
  sharded submodule (Note [torch classes that meet shards] in engine/guards.py).
The rest is per object: the sharded model's own methods and hooks (each module's
``zero_grad`` and each optimizer's holding shards are shadowed on the instance: Note
[zero_grad reaches held gradients] in engine/zero_grad.py), the retired class of
an original parameter replaced by its shard (``guards.retire``), and, only while a
``sw.sharded_init`` block runs, a module registration hook (engine/sharded_init.py).
"""

from __future__ import annotations

from typing import Any

import torch

from . import plain_step
from .guards import check_step
from .offload.step import after_step, step_by_unit

_installed = False


def install_step_hooks() -> None:
    """Install the step hooks of Note [the optimizer step], once per process."""
    global _installed
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
    changed = step_by_unit(optimizer, args, kwargs)  # Note [stepping unit by unit]
    if changed is None:
        plain_step.enter(optimizer, args, kwargs)  # Note [plain step]
    return changed


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step 3 of Note [the optimizer step]."""
    plain_step.leave(optimizer)
    after_step(optimizer, args, kwargs)
