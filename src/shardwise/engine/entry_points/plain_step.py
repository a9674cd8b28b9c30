"""The optimizer step over plain local tensors: DTensor's dispatch left out.

Note [plain step]
A sharded parameter is a DTensor (Note [DTensor parameters] in engine/iteration/unit.py), so every
operation an optimizer runs on it, on its gradient and on its state goes through DTensor's
dispatch: sharding propagation and wrapping for each op of each parameter, which made
AdamW's step cost well above its arithmetic on a rank's elements (BENCHMARKS.md,
"Optimizer step", has the times before and after; issue 34). For the
``torch.optim`` optimizers that update each element from its own gradient and state
(``PER_PARAMETER``), that dispatch computes nothing: every op is elementwise on the local
tensors. So for their step, when nothing else needs the DTensors, the global step
pre-hook (Note [the optimizer step] in engine/entry_points/step.py, which calls :func:`enter` and
:func:`leave`) hands the optimizer the local tensors instead:

- each parameter group's ``params`` becomes the parameters' local tensors (views of the
  shard buffers), each with its gradient's local tensor as ``.grad``;
- the optimizer's state for each local tensor is the state of its parameter with every
  DTensor replaced by its local tensor: views of the same memory, updated in place.

The step then runs the same kernels on the same local tensors that DTensor would have
run, so the result is the same bits. A post-hook undoes the swap: the groups hold the
parameters again, and state the step created (the first step's moments) is wrapped as
DTensors placed like their parameters and stored under the parameters, so
``optimizer.state_dict()``, ``load_state_dict``, ``param_groups`` edits, LR schedulers
and checkpoints see exactly what they saw before. A step that raised leaves the swap in
place until the next step or ``state_dict``/``load_state_dict`` call undoes it.

Left on the DTensor path, whole groups at a time: any other optimizer (one that reads
whole matrices, such as Adafactor or Muon, gets the right answer there), a step with a
closure (it would compute gradients into the DTensors), ``differentiable=True``, groups
holding anything but shards of a sharded model with DTensor gradients and state, and
offloaded groups (they have a step of their own, Note [stepping unit by unit]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..._registry import PLAIN_STEP, PLAIN_STEP_HOOKED, attach_to, attached, detach_from
from ..groups.parts import PER_PARAMETER
from ..iteration.unit import sharded_param


def enter(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Before a step: hand the optimizer local tensors where that is exact."""
    leave(optimizer)  # a step that raised left its swap behind
    if not _eligible(optimizer, args, kwargs):
        return
    record = []
    for group in optimizer.param_groups:
        params = group["params"]
        locals_ = [_local(optimizer, p) for p in params]
        if not params or any(t is None for t in locals_):
            continue
        for p, t in zip(params, locals_):
            assert t is not None
            t.grad = None if p.grad is None else p.grad._local_tensor
            state = optimizer.state.get(p)
            if state:
                optimizer.state[t] = {k: v._local_tensor if isinstance(v, DTensor) else v
                                      for k, v in state.items()}
        record.append((group, params, locals_))
        group["params"] = locals_
    if record:
        if not attached(optimizer, PLAIN_STEP_HOOKED):
            # state_dict() and load_state_dict() must never see the swap.
            optimizer.register_state_dict_pre_hook(leave)
            optimizer.register_load_state_dict_pre_hook(lambda o, _sd: leave(o))
            attach_to(optimizer, PLAIN_STEP_HOOKED, True)
        attach_to(optimizer, PLAIN_STEP, record)


def leave(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """After a step (or before anything reads the optimizer): the parameters back in
    their groups, and their state as DTensors under them."""
    record = attached(optimizer, PLAIN_STEP)
    if record is None:
        return
    detach_from(optimizer, PLAIN_STEP)
    for group, params, locals_ in record:
        group["params"] = params
        for p, t in zip(params, locals_):
            t.grad = None
            state = optimizer.state.pop(t, None)
            if state is not None:
                optimizer.state[p] = _as_dtensors(p, optimizer.state.get(p) or {}, state)


def _as_dtensors(p: DTensor, before: dict, after: dict) -> dict:
    """``after`` (the local step's state of ``p``) with each tensor shaped like the local
    parameter wrapped as a DTensor placed like ``p``, reusing the DTensors it came from."""
    out = {}
    local = p._local_tensor
    for k, v in after.items():
        prev = before.get(k)
        if isinstance(prev, DTensor) and prev._local_tensor is v:
            out[k] = prev
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == local.shape:
            with torch.no_grad():
                out[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
        else:
            out[k] = v
    return out


def _eligible(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    cls = type(optimizer)
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    return (cls.__module__.startswith("torch.optim") and cls.__name__ in PER_PARAMETER
            and closure is None and not optimizer.defaults.get("differentiable", False))


def _local(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s local tensor if its step can run on it (Note [plain step]), else None."""
    sp = sharded_param(p)
    if sp is None or sp.shard is not p or not isinstance(p, DTensor):
        return None
    if sp.group is None or not sp.group.steps_in_place:
        return None
    if p.grad is not None and not isinstance(p.grad, DTensor):
        return None
    state = optimizer.state.get(p) or {}
    if any(isinstance(v, torch.Tensor) and v.dim() > 0 and not isinstance(v, DTensor)
           for v in state.values()):
        return None
    return p._local_tensor
