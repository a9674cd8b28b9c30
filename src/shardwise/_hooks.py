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

from collections.abc import Mapping
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
        # Detached aliases, not the inputs themselves: outputs that are inputs would be
        # views made inside a custom Function, which autograd forbids modifying in place
        # (``x += 1`` at the top of a block). No copy is made.
        return tuple(t.detach() for t in tensors)

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
    if model.checking:
        model.check_unit(unit)
    unit.finish_gather()
    model.record_call(unit)
    flat, spec = tree_flatten((args, kwargs))
    cast = unit.cast_inputs
    if cast is not None:  # mixed precision: floating inputs meet param_dtype weights
        flat = [t.to(cast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in flat]
    if not torch.is_grad_enabled():
        return tree_unflatten(flat, spec) if cast is not None else None
    unit.forward_calls += 1
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        # The end-of-backward callback reduces this unit.
        return tree_unflatten(flat, spec) if cast is not None else None
    wrapped = _PostBackward.apply(unit, *(flat[i] for i in idx))
    for i, t in zip(idx, wrapped):
        flat[i] = t
    return tree_unflatten(flat, spec)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size)


def _output_tensors(output: Any) -> tuple[list[torch.Tensor], bool]:
    """Every tensor in a forward's output, and whether some part could not be searched.

    Tuples, lists and mappings (a Hugging Face ``ModelOutput`` is one) are walked
    directly; anything else goes through torch's pytree, and what that cannot open
    either makes the output opaque.
    """
    found: list[torch.Tensor] = []
    opaque = False
    stack = [output]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif not isinstance(x, _PLAIN):
            leaves = tree_flatten(x)[0]
            if len(leaves) == 1 and leaves[0] is x:
                opaque = True
            else:
                stack.extend(leaves)
    return found, opaque


def post_forward(unit: "Unit", module: torch.nn.Module, args: tuple, kwargs: dict,
                 output: Any) -> None:
    if _in_backward():  # Note [recompute]
        return None
    model = unit.model
    hooked = opaque = False
    if torch.is_grad_enabled():
        index = unit.call_index
        tensors, opaque = _output_tensors(output)
        for t in tensors:
            if t.requires_grad:
                t.register_hook(lambda grad, index=index: model.on_pre_backward(unit, index))
                hooked = True
    if unit.is_root:
        model.on_root_post_forward(hooked, opaque)
    elif not torch.is_grad_enabled():
        unit.reshard()
    elif unit.reshard_after_forward and (hooked or not any(p.requires_grad for p in unit.params)):
        # Without a hooked output nothing would gather the unit again before its
        # backward, so an unhooked trainable unit stays gathered until backward ends.
        unit.reshard()
    return None
