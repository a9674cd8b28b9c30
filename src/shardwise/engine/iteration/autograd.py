"""Autograd glue: where a unit's backward ends, and which forward outputs lead back to it.

Note [recompute]
Activation checkpointing re-runs a unit's forward during backward. That recomputation
must neither reshard (backward still needs the full parameters) nor count as a new call,
so the forward events only make sure the unit is gathered while autograd is executing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .unit import Unit


def in_backward() -> bool:
    """Whether autograd is executing a backward on this thread (Note [recompute])."""
    return torch._C._current_graph_task_id() != -1


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, unit: Unit, *tensors: torch.Tensor):
        ctx.unit = unit
        # Detached aliases, not the inputs themselves: outputs that are inputs would be
        # views made inside a custom Function, which autograd forbids modifying in place
        # (``x += 1`` at the top of a block). No copy is made.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.model.on_post_backward(ctx.unit)
        return (None, *grads)


def prepare_inputs(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A unit's inputs, cast for mixed precision and routed through :class:`PostBackward`
    when they require grad; ``None`` when nothing changes. Counts the call."""
    flat, spec = tree_flatten((args, kwargs))
    cast = unit.cast_inputs
    if cast is not None:  # mixed precision: floating inputs meet param_dtype weights
        flat = [t.to(cast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in flat]
    changed = cast is not None
    if torch.is_grad_enabled():
        unit.record_forward()
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if idx:  # else the end-of-backward callback reduces this unit
            wrapped = PostBackward.apply(unit, *(flat[i] for i in idx))
            for i, t in zip(idx, wrapped):
                flat[i] = t
            changed = True
    return tree_unflatten(flat, spec) if changed else None


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size)


def output_tensors(output: Any) -> tuple[list[torch.Tensor], bool]:
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
