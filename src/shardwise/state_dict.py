"""Consolidated (full) state dicts of sharded models."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ._order_check import announce
from ._peers import operation
from ._registry import model_state, sharded_param


@operation("full_state_dict")
def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded module's ``state_dict()``, consolidated on CPU.

    Same keys as the unsharded module (original names; a tied weight under each name, as
    separate tensors), shapes and dtypes; parameters and persistent buffers. One unit is
    gathered at a time, so memory stays near one unit plus the CPU result. Every rank must
    call it.

    Args:
        module: a sharded root (an unsharded module is simply copied to CPU).
        rank0_only: return an empty dict on ranks other than 0 of the model's group (of
            the world, for an unsharded module).

    Returns:
        ``{name: CPU tensor}``, or ``{}`` on other ranks when ``rank0_only``. Raises nothing
        of its own.

    Example:
        >>> sd = sw.full_state_dict(model)
        >>> if dist.get_rank() == 0:
        ...     safetensors.torch.save_file(sd, "model.safetensors")
    """
    state = model_state(module)
    if state is not None:
        keep = not rank0_only or state.comm.rank == 0
    else:
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    announce(state.comm if state is not None else None, "full_state_dict")
    sd = module.state_dict(keep_vars=True)
    full: dict[int, torch.Tensor] = {}
    if state is not None:
        for unit in state.units:
            for g in unit.groups:
                flat = g.gather_full()
                if keep:
                    for p in g.params:
                        full[id(p)] = g.full_value(p, flat).to("cpu", copy=True)
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    given: set[int] = set()
    for key, value in sd.items():
        sp = sharded_param(value) if isinstance(value, torch.Tensor) else None
        if sp is not None:
            # A tied weight gets its own copy under each further name, so the result can
            # go straight to safetensors, which refuses tensors sharing memory.
            out[key] = full[id(sp)].clone() if id(sp) in given else full[id(sp)]
            given.add(id(sp))
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu", copy=True)
        else:
            out[key] = value
    return out
