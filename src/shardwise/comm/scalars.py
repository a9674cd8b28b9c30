"""Python scalars of sharded values: the whole tensor's, or a loud error, never one rank's.

Note [rank-local scalars]
A sharded parameter is a DTensor, so ``p.grad.norm()`` and ``p.sum()`` are DTensors
whose placement is ``Partial``: each rank holds its rows' contribution, and the value is
their reduction. DTensor turns such a tensor into a Python number (``.item()``,
``float()``, ``bool()``) from the local contribution alone, without a word: code written
for DDP that logs per-parameter norms logs this rank's part (reported: 0.597 where DDP
logs 0.769). FSDP2 does exactly the same (measured on a two-layer model at 2 ranks:
the same rank-local values, bit for bit, from its parameters as from shardwise's).

Reducing inside ``.item()`` would be correct only when every rank calls it; the common
``if rank == 0: log(p.grad.norm().item())`` would then hang. So a DTensor on one of
shardwise's meshes that is not replicated raises instead, saying what to write:
``p.grad.norm().full_tensor().item()`` on every rank. DTensors of other meshes (FSDP2's,
tensor parallelism's) behave as torch makes them. The check is one entry in DTensor's
table of special operations, added when shardwise first builds a mesh; torch consults
that table only for ``_local_scalar_dense``, so nothing else is slowed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..errors import ShardwiseError

_OP = torch.ops.aten._local_scalar_dense.default
_MARK = "_shardwise_mesh"


def mark(mesh: Any) -> None:
    """Make ``mesh`` one of shardwise's, and install the check (once per process)."""
    setattr(mesh, _MARK, True)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    if getattr(handlers.get(_OP), _MARK, False):
        return
    previous = handlers.get(_OP)

    def to_scalar(op_call: Any, args: tuple, kwargs: dict) -> Any:
        t = args[0]
        mesh = t.device_mesh
        if getattr(mesh, _MARK, False) and mesh.size() > 1 and not all(
                isinstance(p, Replicate) for p in t.placements):
            raise ShardwiseError(
                f"a Python number was asked of a sharded value whose placement is "
                f"{t.placements} (each rank holds only its part): `.item()`, `float()` "
                f"or `bool()` would give this rank's part, not the whole tensor's. "
                f"Reduce it first, on every rank (a collective): "
                f"`p.grad.norm().full_tensor().item()`, `p.full_tensor().sum().item()`; "
                f"or use `sw.clip_grad_norm_`, whose result is a plain tensor")
        if previous is not None:
            return previous(op_call, args, kwargs)
        return op_call(t.to_local(), *args[1:], **kwargs)

    setattr(to_scalar, _MARK, True)
    handlers[_OP] = to_scalar
