"""One builder of a sharded model's engine, for ``shard`` and for deep copies alike.

Both hand it the units' flat groups, already holding this rank's rows, and the
:class:`~shardwise.engine.state.Settings` that ``shard`` was given; every setting goes to a
constructor, nothing is set from outside afterwards. The builder makes the units and the
model state and attaches what a sharded model carries beyond its module hooks: registry
entries, the end-of-backward trigger, the guards. (Module hooks are registered by
``shard`` and copied with their modules by a deep copy, ``engine/hooks.py``; the copy
guard by :func:`shardwise.engine.clone.guard_model_copies`.)
"""

from __future__ import annotations

import torch.nn as nn

from .._registry import mark_collective_forward
from ..comm.mesh import Topology
from .buffers import BufferSync
from .guards import guard_apply, guard_ddp, guard_resize, guard_save_pretrained
from .packed import PackedGroup
from .state import ModelState, Settings, set_model_state
from .unit import FlatGroup, Unit, set_unit
from .zero_grad import guard_module_zero_grad


def build(root: nn.Module, topology: Topology,
          units: list[tuple[str, nn.Module, list[FlatGroup], list[PackedGroup]]],
          buffers: BufferSync, settings: Settings) -> ModelState:
    """The engine of ``root``'s sharded model: ``units`` are ``(name, module, groups,
    packed groups)``, the root's first, in module order."""
    built = [Unit(module, name, [*groups, *packed], settings.reshard_after_forward,
                  is_root=(i == 0), cast_inputs=settings.cast_inputs)
             for i, (name, module, groups, packed) in enumerate(units)]
    state = ModelState(root, topology, built, buffers, settings)
    for unit in built:
        set_unit(unit.module, unit)
        for sp in unit.params:
            if sp.requires_grad:  # one unfrozen later is hooked then (follow_freezing)
                sp.hook_end_of_backward()
    set_model_state(root, state)
    guard_save_pretrained(root)
    guard_resize(root)
    guard_ddp(root)
    for sub in root.modules():
        mark_collective_forward(sub)
        guard_apply(sub)
        guard_module_zero_grad(sub)  # Note [zero_grad reaches held gradients]
    return state
