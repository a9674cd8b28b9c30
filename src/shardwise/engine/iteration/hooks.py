"""The module hooks: a thin adapter from torch's hook signatures to the model's events.

Every decision lives in :class:`shardwise.engine.iteration.state.ModelState` (one method per event);
the autograd pieces (the post-backward identity, output search) in ``engine/iteration/autograd.py``.
Each hook finds its unit through the module it is called on, not through a bound
argument, so that a deep copy of the model (``engine/clone.py``), whose modules carry copies of
these hooks, drives its own units. The hooks on a wrapper root's inner models, which run
them as the root when they are called on their own, are here too (Note [forward entries]
in engine/iteration/state.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .unit import Unit, unit_of


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


@torch._dynamo.disable
def forward_raised(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """Called after every call of a unit, also one that raised (Note [a forward that
    raised] in engine/iteration/state.py); acts only in the latter case."""
    unit = unit_of(module)
    assert unit is not None, "a unit's hooks are installed on its module"
    unit.model.on_forward_raised(module)


class RootOf:
    """The root of one sharded model, for the hooks of its entries (Note [forward
    entries] in engine/iteration/state.py). One instance per model, shared by those hooks; a deep
    copy of the model copies it with them, bound to the copy's root."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root

    def unit(self) -> Unit:
        """The root's unit, which an entry's call runs as."""
        unit = unit_of(self.root)
        assert unit is not None, "entries are installed on sharded models only"
        return unit


def wrapped_models(root: torch.nn.Module,
                   unit_modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The root's entries besides itself (Note [forward entries]): from the root down,
    while a module owns no parameter itself and exactly one child holds parameters (and
    so all of them), that child, unless it is a unit."""
    out: list[torch.nn.Module] = []
    module = root
    while next(module.parameters(recurse=False), None) is None:
        holders = [c for c in module.children() if next(c.parameters(), None) is not None]
        if len(holders) != 1 or any(holders[0] is u for u in unit_modules):
            break
        module = holders[0]
        out.append(module)
    return out


def install_entries(root: torch.nn.Module, unit_modules: list[torch.nn.Module]) -> None:
    """Make the modules :func:`wrapped_models` finds run as the root when called outside
    its forward (Note [forward entries]); nothing for a root that is no such wrapper."""
    entries = wrapped_models(root, unit_modules)
    if not entries:
        return
    shared = RootOf(root)
    for module in entries:
        module.register_forward_pre_hook(functools.partial(_entry_pre, shared),
                                         prepend=True, with_kwargs=True)
        module.register_forward_hook(functools.partial(_entry_post, shared),
                                     with_kwargs=True)
        module.register_forward_hook(functools.partial(_entry_raised, shared),
                                     always_call=True)


@torch._dynamo.disable
def _entry_pre(shared: RootOf, module: torch.nn.Module, args: tuple,
               kwargs: dict) -> tuple[tuple, dict] | None:
    unit = shared.unit()
    return unit.model.on_pre_forward(unit, args, kwargs, module)


@torch._dynamo.disable
def _entry_post(shared: RootOf, module: torch.nn.Module, args: tuple, kwargs: dict,
                output: Any) -> Any:
    unit = shared.unit()
    return unit.model.on_post_forward(unit, output, module)  # Note [returned parameters]


@torch._dynamo.disable
def _entry_raised(shared: RootOf, module: torch.nn.Module, args: tuple, output: Any) -> None:
    shared.unit().model.on_forward_raised(module)
