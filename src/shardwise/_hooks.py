"""The module hooks: a thin adapter from torch's hook signatures to the model's events.

Every decision lives in :class:`shardwise._state.ModelState` (one method per event);
the autograd pieces (the post-backward identity, output search) in ``_autograd.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._unit import Unit


# Note [compile]: under torch.compile of a whole sharded model, dynamo must not trace
# these hooks (they swap parameters, issue collectives and keep Python state): they run
# eagerly, as graph breaks, and the module code between them is compiled.
@torch._dynamo.disable
def pre_forward(unit: Unit, module: torch.nn.Module, args: tuple,
                kwargs: dict) -> tuple[tuple, dict] | None:
    return unit.model.on_pre_forward(unit, args, kwargs)


@torch._dynamo.disable
def post_forward(unit: Unit, module: torch.nn.Module, args: tuple, kwargs: dict,
                 output: Any) -> None:
    unit.model.on_post_forward(unit, output)
