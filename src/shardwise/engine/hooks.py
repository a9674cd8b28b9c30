"""The module hooks: a thin adapter from torch's hook signatures to the model's events.

Every decision lives in :class:`shardwise.engine.state.ModelState` (one method per event);
the autograd pieces (the post-backward identity, output search) in ``engine/autograd.py``.
Each hook finds its unit through the module it is called on, not through a bound
argument, so that a deep copy of the model (``engine/clone.py``), whose modules carry copies of
these hooks, drives its own units.
"""

from __future__ import annotations

from typing import Any

import torch

from .unit import unit_of


# Note [compile]: under torch.compile of a whole sharded model, dynamo must not trace
# these hooks (they swap parameters, issue collectives and keep Python state): they run
# eagerly, as graph breaks, and the module code between them is compiled.
@torch._dynamo.disable
def pre_forward(module: torch.nn.Module, args: tuple,
                kwargs: dict) -> tuple[tuple, dict] | None:
    unit = unit_of(module)
    assert unit is not None, "a unit's hooks are installed on its module"
    return unit.model.on_pre_forward(unit, args, kwargs)


@torch._dynamo.disable
def post_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    unit = unit_of(module)
    assert unit is not None, "a unit's hooks are installed on its module"
    unit.model.on_post_forward(unit, output)
