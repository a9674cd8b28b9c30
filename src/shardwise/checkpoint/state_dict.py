"""Consolidated (full) state dicts of sharded models."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._args import require_bool
from ..comm.collectives import Comm
from ..comm.order_check import operation
from ..engine.packed import PackedParam, packed_param
from ..engine.state import owning_state
from ..engine.unit import ShardedParam, sharded_param
from ..errors import ShardwiseError


def _announced(module: nn.Module, **_: Any) -> tuple[Comm, str, int] | None:
    state = owning_state(module)
    return None if state is None else (state.comm, "full_state_dict", state.number)


@operation("full_state_dict", _announced)
def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded module's ``state_dict()``, consolidated on CPU.

    Same keys as the unsharded module (original names; a tied weight under each name, as
    separate tensors), shapes and dtypes; parameters and persistent buffers. One unit is
    gathered at a time, so memory stays near one unit plus the CPU result. Every rank must
    call it.

    Args:
        module: a sharded root, or a submodule of one (keys relative to it; every rank
            passes the same submodule); an unsharded module is simply copied to CPU.
        rank0_only: return an empty dict on ranks other than 0 of the model's group (of
            the world, for an unsharded module).

    Returns:
        ``{name: CPU tensor}``, or ``{}`` on other ranks when ``rank0_only``. Every tensor
        is plain and of its full shape, never a DTensor or a piece.

    Raises:
        ShardwiseError: on every rank, when the module holds a DTensor parameter that is
            not one of its shards (one replaced after ``shard``).

    Example:
        >>> sd = sw.full_state_dict(model)
        >>> if dist.get_rank() == 0:
        ...     safetensors.torch.save_file(sd, "model.safetensors")
    """
    require_bool(rank0_only, "full_state_dict", "rank0_only")
    state = owning_state(module)
    if state is not None:
        keep = not rank0_only or state.comm.rank == 0
    else:
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    sd = module.state_dict(keep_vars=True)
    pieces = [k for k, v in sd.items() if isinstance(v, DTensor) and _param_of(v) is None]
    if pieces:  # every rank sees the same keys: every rank raises, before any collective
        raise ShardwiseError(
            f"full_state_dict would return this rank's rows for {len(pieces)} parameter(s) "
            f"({', '.join(pieces[:3])}{', ...' if len(pieces) > 3 else ''}): DTensors that "
            f"are not shards of this model (a parameter replaced after sw.shard, e.g. by "
            f"load_state_dict(assign=True) or torch.utils.swap_tensors). Replace "
            f"parameters before sw.shard, or load values with model.load_state_dict(sd)")
    full: dict[int, torch.Tensor] = {}
    if state is not None:
        # A submodule of a sharded model gathers the groups holding its parameters only;
        # every rank was given the same submodule, so every rank gathers the same ones.
        wanted = {id(sp) for v in sd.values()
                  if isinstance(v, torch.Tensor) and (sp := _param_of(v)) is not None}
        for unit in state.units:
            for g in unit.groups:
                if not any(id(p) in wanted for p in g.params):
                    continue
                flat = g.gather_full()
                if keep:
                    for p in g.params:
                        full[id(p)] = g.full_value(p, flat).to("cpu", copy=True)
            # Quantized weights come back quantized: the full tensor subclass, its
            # packed bytes gathered as they are (Note [packed parameters]).
            for pg in unit.packed:
                if any(id(pp) in wanted for pp in pg.params):
                    values = pg.gather_full()
                    if keep:
                        for pp, v in zip(pg.params, values):
                            full[id(pp)] = v.to("cpu")
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    given: set[int] = set()
    for key, value in sd.items():
        sp = _param_of(value) if isinstance(value, torch.Tensor) else None
        if sp is not None:
            # A tied weight gets its own copy under each further name, so the result can
            # go straight to safetensors, which refuses tensors sharing memory.
            out[key] = full[id(sp)].clone() if id(sp) in given else full[id(sp)]
            given.add(id(sp))
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu", copy=True)
        else:
            out[key] = value
        if isinstance(value, torch.Tensor):
            _check_full(key, out[key], sp.shape if sp is not None else value.shape)
    return out


def _param_of(t: torch.Tensor) -> ShardedParam | PackedParam | None:
    return sharded_param(t) or packed_param(t)


def _check_full(key: str, got: torch.Tensor, shape: torch.Size) -> None:
    """The promise of :func:`full_state_dict`, checked on every tensor it returns: plain
    and of the full shape, never a DTensor or a piece."""
    if isinstance(got, DTensor) or tuple(got.shape) != tuple(shape):
        raise ShardwiseError(
            f"internal: full_state_dict's value for {key} is a {type(got).__name__} of shape "
            f"{tuple(got.shape)}, not the full {tuple(shape)}; please report this")
