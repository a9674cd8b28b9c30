"""What a module's state is made of: its parameters (sharded or not) and persistent buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .._comm import Comm
from .._registry import init_piece, model_state, sharded_param
from .._unit import ShardedParam, UnitState
from ..errors import ShardwiseError


@dataclass
class ParamTarget:
    """One parameter of the module, under every name it has in ``state_dict()``."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: ShardedParam | None
    plain: torch.Tensor | None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def local_range(self) -> tuple[int, int]:
        """(offset into the flattened parameter, element count) this rank stores."""
        if self.sharded is not None:
            return self.sharded.piece.param_offset, self.sharded.piece.numel
        return 0, self.numel

    def local_values(self) -> torch.Tensor:
        """This rank's elements, flattened."""
        if self.sharded is not None:
            return self.sharded.local.detach().reshape(-1)
        assert self.plain is not None
        return self.plain.detach().reshape(-1)

    def write_local(self, values: torch.Tensor) -> None:
        with torch.no_grad():
            if self.sharded is not None:
                self.sharded.local.view(-1).copy_(values.reshape(-1))
            else:
                assert self.plain is not None
                self.plain.copy_(values.reshape(self.shape))


def module_targets(module: nn.Module) -> tuple[list[ParamTarget], dict[str, torch.Tensor]]:
    """The parameters (each once, with all its names) and persistent buffers of ``module``."""
    params: dict[int, ParamTarget] = {}
    buffers: dict[str, torch.Tensor] = {}
    param_ids = {id(p) for p in module.parameters()}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        sp = sharded_param(value)
        if init_piece(value) is not None or (sp is None and value.is_meta):
            raise ShardwiseError(
                f"{name} is not materialised (built under sw.sharded_init or on the meta "
                f"device): call sw.shard(model) first, then load into the sharded model")
        if sp is not None:
            key = id(sp)
            if key not in params:
                params[key] = ParamTarget([], tuple(sp.shape), sp.dtype, sp, None)
        elif id(value) in param_ids:
            key = id(value)
            if key not in params:
                params[key] = ParamTarget([], tuple(value.shape), value.dtype, None, value)
        else:
            buffers[name] = value
            continue
        params[key].names.append(name)
    state = model_state(module)
    if state is not None:
        state.recover()
    for t in params.values():
        unit = t.sharded.unit if t.sharded is not None else None
        if unit is not None and unit.state is not UnitState.SHARDED:
            raise ShardwiseError("cannot load or save state while the model is inside its "
                                 "forward/backward or a gathered() block")
    return list(params.values()), buffers


def comm_of(module: nn.Module) -> Comm | None:
    state = model_state(module)
    if state is not None:
        return state.comm
    return Comm(None) if dist.is_initialized() else None


def apply_values(values: list[tuple[ParamTarget, torch.Tensor]],
                 buffer_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write planned parameter rows and buffer values into the model."""
    for t, v in values:
        t.write_local(v)
    with torch.no_grad():
        for b, v in buffer_values:
            b.copy_(v)
