"""Autograd glue: where a unit's backward ends, which forward outputs lead back to it, and
which backward is the iteration's.

Note [recompute]
Activation checkpointing re-runs a unit's forward during backward. That recomputation
must neither reshard (backward still needs the full parameters) nor count as a new call,
so the forward events only make sure the unit is gathered while autograd is executing.

Note [a backward that accumulates nothing]
``torch.autograd.grad(loss, x)`` runs a backward through the model that accumulates into
no parameter (a saliency map, an adversarial example's input gradient, a gradient
penalty). DDP's reducer, hooked on the parameters' accumulation, does not see it. Here
it reached the units' hooks and counted as the iteration's backward: it reduced and
published what ``no_sync`` had accumulated, then the loss's own backward reduced the
rest, a sum in another order than DDP's (one ulp apart), refused outright by the
reproducible mode as a second mean. So the first hook of a backward asks autograd
whether it will accumulate into the model's trainable parameters (one full parameter's
``AccumulateGrad`` node per trainable group, ``torch._C._will_engine_execute_node``). If
not, the backward is set aside (:class:`AsideBackward`): units are gathered for it as for any
backward, nothing is counted or reduced, the phase stays, and its end releases what it
gathered. A parameter's gradient arriving after all (``backward(inputs=...)`` naming a
parameter the probe did not ask about, a reentrant checkpoint whose parameters only its
inner backward reaches) makes it the iteration's backward on the spot; the units whose
backward was skipped until then are reduced at its end, as units whose gradients came
without a counted forward are. A backward set aside that records a graph (``create_graph
=True``: a gradient penalty) keeps what it gathered, since that graph computes with the
full parameters, and the backward through it reduces every unit at its end, once the
penalty's gradients have come too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .residency import release

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


class AsideBackward:
    """A backward that accumulates into no parameter of the model, set aside (Note [a
    backward that accumulates nothing]): what it gathered, and whether the backward
    through the graph it recorded reduces every unit at its end."""

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.gathered_for: list[Unit] | None = None  # sharded when it began; None: none runs
        self.reduce_at_end = False

    @property
    def running(self) -> bool:
        return self.gathered_for is not None

    def accumulates(self) -> bool:
        """Whether the running backward will accumulate into a trainable parameter of
        the model: one full parameter per trainable group asked."""
        for u in self.units:
            for g in u.trainable_groups:
                p = next((p for p in g.params if p.requires_grad and p.full.requires_grad),
                         None)
                if p is None:
                    continue
                if p.accumulator is None:
                    with torch.enable_grad():  # a backward runs with gradients off
                        node = p.full.view_as(p.full).grad_fn
                    assert node is not None, "a view of a leaf that requires grad"
                    p.accumulator = node.next_functions[0][0]
                if torch._C._will_engine_execute_node(p.accumulator):
                    return True
        return False

    def start(self) -> None:
        """The running backward gathers what it needs and reduces nothing; its end puts
        the units back as the forward left them, unless it records a graph a later
        backward runs through."""
        self.gathered_for = [u for u in self.units if u.is_sharded()]
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def forget(self) -> None:
        """It became the iteration's backward (a parameter's gradient came), or never
        reached its end (it raised)."""
        self.gathered_for = None

    def abandon(self) -> None:
        """The iteration is abandoned: nothing is set aside, nothing waits for an end."""
        self.gathered_for = None
        self.reduce_at_end = False

    def _end(self) -> None:
        if self.gathered_for is None:  # became the iteration's backward
            return
        gathered_for, self.gathered_for = self.gathered_for, None
        if torch.is_grad_enabled():
            # It recorded a graph through the full parameters (a gradient penalty's
            # torch.autograd.grad(..., create_graph=True)): they stay gathered, and the
            # backward through it reduces at its end, when every gradient has come.
            self.reduce_at_end = True
            return
        for u in gathered_for:
            release(u)
