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


# Note [compile]
# Under torch.compile of a whole sharded model, dynamo must not trace these hooks (they
# swap parameters, issue collectives and keep Python state): they run eagerly, and each
# unit's forward is compiled as a graph of its own, between its hooks. Its parameters
# change identity at each gather (shards, then full parameters), so dynamo must read them
# when the graph runs rather than bake them in or guard on them: every module of a sharded
# model carries FSDP's two markers (``mark_collective_forward`` in _registry.py), under
# which dynamo treats it as FSDP with original parameters and does exactly that. A root
# that calls its units in a loop (``for block in self.blocks``) is not captured: dynamo
# does not resume after a graph break inside a loop, so it runs that frame eagerly, and
# the root's own code (embeddings, the head, the loss) with it, while each unit's forward
# is compiled. Losses matched compiled DDP's bit for bit on the machine of
# tests/test_compile.py.
@torch._dynamo.disable
def pre_forward(module: torch.nn.Module, args: tuple,
                kwargs: dict) -> tuple[tuple, dict] | None:
    unit = unit_of(module)
    assert unit is not None, "a unit's hooks are installed on its module"
    return unit.model.on_pre_forward(unit, args, kwargs)


@torch._dynamo.disable
def post_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    unit = unit_of(module)
    assert unit is not None, "a unit's hooks are installed on its module"
    return unit.model.on_post_forward(unit, output)
