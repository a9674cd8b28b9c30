"""``zero_grad`` on a sharded model and its optimizers: it reaches the gradients the
engine holds.

The engine keeps a step's state where torch's entry points do not look: gradients held
across ``no_sync`` micro-batches (in a held unit's full parameters, or in a group's
reduction buffer) and the full parameters autograd computes with. A program written for
DDP reaches the parameters the module and the optimizer hold, the shards. Each entry
point is carried from the shard to the engine's state where the engine keeps it: this
module for ``zero_grad``, Note [tensor hooks on shards] in engine/groups/flat.py for tensor
hooks, Note [flags of a forward without gradients] in engine/iteration/unit.py for
``requires_grad``, Note [edits of held parameters] in engine/iteration/unit.py for in-place edits.
The whole table, every entry point in every mode, is in docs/parameters.md ("Torch's
entry points").

Note [zero_grad reaches held gradients]
Under DDP, ``optimizer.zero_grad()`` and ``model.zero_grad()`` clear the local ``.grad``
that ``no_sync`` micro-batches accumulated. Here those gradients wait in the engine (Note
[gathered across micro-batches] in engine/iteration/state.py), out of ``zero_grad``'s reach: a
micro-batch loop abandoned half way (an exception, a skipped batch), then ``zero_grad``
and a fresh step, carried the abandoned gradient into that step, silently. So every
optimizer holding shards and every module of a sharded model has its ``zero_grad``
shadowed on the instance (the class is left alone): torch's own runs, then the held
gradients of the parameters it covers are dropped (``Residencies.clear_grads``, Note
[residency] in engine/iteration/residency.py), on this
rank, as DDP's are. ``set_to_none`` True and False clear alike (False leaves zeros where
DDP's leaves zeros; the shard's ``.grad`` is torch's to zero). Clearing a parameter's
gradient by hand (``p.grad = None``) is not seen: use ``zero_grad``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from ..._registry import set_instance_method
from ..iteration.state import ModelState, owning_state
from ..iteration.unit import sharded_param


def _states(tensors: Iterable[torch.Tensor]) -> list[ModelState]:
    """The sharded models owning any of ``tensors``, each once."""
    out: list[ModelState] = []
    for t in tensors:
        sp = sharded_param(t)
        if sp is not None and sp.unit is not None and all(sp.unit.model is not s for s in out):
            out.append(sp.unit.model)
    return out


# Each optimizer's models, found once per set of parameters: zero_grad runs every step,
# and looking up every parameter's model each time cost more than torch's own zero_grad.
_optimizer_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _optimizer_zero_grad(original: Callable[..., None], optimizer: torch.optim.Optimizer,
                         set_to_none: bool = True) -> None:
    original(set_to_none)
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    known = _optimizer_models.get(optimizer)
    if known is None or known[0] != count:
        states = [weakref.ref(s) for s in
                  _states(p for g in optimizer.param_groups for p in g["params"])]
        known = _optimizer_models[optimizer] = (count, states)
    for ref in known[1]:
        state = ref()
        if state is not None and state.residency.holds_grads():
            state.residency.clear_grads(
                [p for g in optimizer.param_groups for p in g["params"]])


def _module_zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    type(module).zero_grad(module, set_to_none)
    state = owning_state(module)
    if state is not None and state.residency.holds_grads():
        state.residency.clear_grads(list(module.parameters()))


def guard_optimizer_zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Note [zero_grad reaches held gradients], for an optimizer holding shards."""
    set_instance_method(optimizer, "zero_grad", functools.partial(
        _optimizer_zero_grad, optimizer.zero_grad, optimizer))


def guard_module_zero_grad(module: nn.Module) -> None:
    """Note [zero_grad reaches held gradients], for a module of a sharded model."""
    set_instance_method(module, "zero_grad", functools.partial(_module_zero_grad, module))
