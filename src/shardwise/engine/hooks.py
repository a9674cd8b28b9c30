"""The module hooks: a thin adapter from torch's hook signatures to the model's events.

Every decision lives in :class:`shardwise.engine.state.ModelState` (one method per event);
the autograd pieces (the post-backward identity, output search) in ``engine/autograd.py``.
Each hook finds its unit through the module it is called on, not through a bound
argument, so that a deep copy of the model (``engine/clone.py``), whose modules carry copies of
these hooks, drives its own units. The hooks on a wrapper root's inner models, which run
them as the root when they are called on their own, are here too (Note [wrapped roots]).
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
    raised] in engine/state.py); acts only in the latter case."""
    unit = unit_of(module)
    assert unit is not None, "a unit's hooks are installed on its module"
    unit.model.on_forward_raised(unit)


# Note [wrapped roots]
# A root whose forward only hands its inputs to one child (a PEFT ``PeftModel`` wrapping
# the ``LlamaForCausalLM`` it adapts, through its ``LoraModel``) is not always entered
# through that forward: ``PeftModel.generate`` calls the inner model's ``generate``, whose
# loop calls the inner model itself. The root unit's parameters (the embedding, the final
# norm, the head) are then used without the root's forward hook, as DTensor shards, and
# the first op mixing them with the inputs fails ("got mixed torch.Tensor and DTensor").
# So each module of that chain (a module owning no parameter itself whose parameters all
# live in one child, not a unit, descending from the root) is an entry of the root: called
# while no forward of the root or of another entry runs, its forward is the root's forward,
# with the root's own events (gather the root unit, record the order, release or await the
# backward), so every rank issues the same collectives as for a call of the root. Called
# inside the root's forward (``PeftModel.forward`` calls it), it does nothing. ``generate``
# on the inner model sees the markers of ``mark_collective_forward`` and turns on
# ``synced_gpus``, so ranks whose sequences stop at different lengths run the same number
# of forwards, as for a sharded model that is not wrapped.
class RootEntries:
    """Which forwards of one model's root and entries are running (Note [wrapped roots]).

    One instance per model, shared by the hooks on its root and entries (a deep copy of
    the model copies it with them, bound to the copy's root). ``running`` holds, per
    forward under way, whether it started the root's forward itself."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.running: list[bool] = []

    def root_unit(self) -> Unit:
        unit = unit_of(self.root)
        assert unit is not None, "entries are installed on sharded models only"
        return unit


def wrapped_models(root: torch.nn.Module,
                   unit_modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The root's entries (Note [wrapped roots]): from the root down, while a module owns
    no parameter itself and exactly one child holds parameters (and so all of them), that
    child, unless it is a unit."""
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
    its forward (Note [wrapped roots]); nothing for a root that is no such wrapper."""
    entries = wrapped_models(root, unit_modules)
    if not entries:
        return
    shared = RootEntries(root)
    # The pre-hooks come first and the bookkeeping post-hooks are always called, also when
    # the forward or another hook raises, so that ``running`` never stays stale.
    root.register_forward_pre_hook(functools.partial(_enter, shared, False), prepend=True)
    root.register_forward_hook(functools.partial(_leave, shared), always_call=True)
    for module in entries:
        module.register_forward_pre_hook(functools.partial(_enter, shared, True),
                                         prepend=True, with_kwargs=True)
        module.register_forward_hook(functools.partial(_entry_end, shared), with_kwargs=True)
        module.register_forward_hook(functools.partial(_leave, shared), always_call=True)


@torch._dynamo.disable
def _enter(shared: RootEntries, entry: bool, module: torch.nn.Module, args: tuple,
           kwargs: dict | None = None) -> tuple[tuple, dict] | None:
    starts = entry and not shared.running
    shared.running.append(starts)
    if not starts:
        return None
    unit = shared.root_unit()
    assert kwargs is not None, "an entry's pre-hook is registered with kwargs"
    return unit.model.on_pre_forward(unit, args, kwargs)


@torch._dynamo.disable
def _entry_end(shared: RootEntries, module: torch.nn.Module, args: tuple, kwargs: dict,
               output: Any) -> Any:
    if shared.running and shared.running[-1]:
        unit = shared.root_unit()
        return unit.model.on_post_forward(unit, output)  # Note [returned parameters]
    return None


@torch._dynamo.disable
def _leave(shared: RootEntries, module: torch.nn.Module, args: tuple, output: Any) -> None:
    if shared.running:
        shared.running.pop()
