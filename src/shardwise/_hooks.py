"""Hooks that drive the unit state machine from forward and backward.

- forward pre-hook: gather the unit (waiting for a prefetch), prefetch the next unit, and
  route grad-requiring inputs through :class:`_PostBackward`;
- forward post-hook: hook the outputs (pre-backward) and reshard;
- pre-backward (a hook on each output): gather again and prefetch the previous unit;
- post-backward (:class:`_PostBackward` on the inputs): reduce-scatter the gradients.
  The end-of-backward callback of :class:`shardwise._state.ModelState` catches everything
  the input hook could not see (unused units, inputs without grad, the root).

Note [recompute]
Activation checkpointing re-runs a unit's forward during backward. That recomputation
must neither reshard (backward still needs the full parameters) nor count as a new call,
so both hooks only make sure the unit is gathered when autograd is executing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from ._unit import Unit


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, unit: "Unit", *tensors: torch.Tensor):  # type: ignore[override]
        ctx.unit = unit
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.unit.model.on_post_backward(ctx.unit)
        return (None, *grads)


def pre_forward(unit: "Unit", module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    if _in_backward():  # Note [recompute]
        unit.finish_gather()
        return None
    model = unit.model
    if unit.is_root:
        model.on_root_pre_forward()
    unit.finish_gather()
    model.record_call(unit)
    if not torch.is_grad_enabled():
        return None
    unit.forward_calls += 1
    flat, spec = tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None  # the end-of-backward callback reduces this unit
    wrapped = _PostBackward.apply(unit, *(flat[i] for i in idx))
    for i, t in zip(idx, wrapped):
        flat[i] = t
    return tree_unflatten(flat, spec)


def post_forward(unit: "Unit", module: torch.nn.Module, args: tuple, kwargs: dict,
                 output: Any) -> None:
    if _in_backward():  # Note [recompute]
        return None
    model = unit.model
    hooked = False
    if torch.is_grad_enabled():
        index = unit.call_index
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, index=index: model.on_pre_backward(unit, index))
                hooked = True
    if unit.is_root:
        model.on_root_post_forward(hooked)
    elif not torch.is_grad_enabled():
        unit.reshard()
    elif unit.reshard_after_forward and (hooked or not any(p.requires_grad for p in unit.params)):
        # Without a hooked output nothing would gather the unit again before its
        # backward, so an unhooked trainable unit stays gathered until backward ends.
        unit.reshard()
    return None
