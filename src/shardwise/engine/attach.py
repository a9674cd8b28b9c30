"""What a sharded model carries beyond its module hooks.

Attached by ``shard`` and by a deep copy of a sharded model (``engine/clone.py``) alike.
"""

from __future__ import annotations

import torch.nn as nn

from .._registry import mark_collective_forward
from .guards import guard_apply, guard_ddp, guard_save_pretrained
from .state import ModelState, set_model_state
from .unit import set_unit


def attach(state: ModelState) -> None:
    """Make ``state`` its model's: registry entries, the end-of-backward trigger on every
    trainable full parameter, and the guards (module copies inherit the hooks, engine/hooks.py;
    the copy guard is installed by :func:`shardwise.engine.clone.guard_model_copies`)."""
    module: nn.Module = state.root
    for unit in state.units:
        set_unit(unit.module, unit)
        for sp in unit.params:
            if sp.requires_grad:
                sp.full.register_post_accumulate_grad_hook(
                    lambda _p, s=state: s.ensure_backward_callback())
    set_model_state(module, state)
    guard_save_pretrained(module)
    guard_ddp(module)
    for sub in module.modules():
        mark_collective_forward(sub)
        guard_apply(sub)
