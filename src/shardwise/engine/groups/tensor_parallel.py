"""Tensor parallelism composed with sharding: parameters that torch's
``parallelize_module`` placed on a tensor-parallel mesh, sharded on their local tensors
over the data-parallel ranks (Note [tensor-parallel parameters]).

Note [tensor-parallel parameters]
FSDP2's order: ``parallelize_module(model, mesh["tp"], plan)`` makes some parameters
DTensors on the tp mesh (a Linear's weight ``Shard(0)`` under ``ColwiseParallel``,
``Shard(1)`` under ``RowwiseParallel``, ``Replicate()`` for ``SequenceParallel``'s norms),
then ``sw.shard(model, mesh=mesh["dp"])`` shards them over dp. A rank holds the local
tensor of its tp coordinate, and shardwise shards that local tensor, never the global one:

- the plan sees a stand-in (:func:`stand_in`): a plain parameter holding the local tensor
  and carrying a :class:`TpSpec` (the tp mesh and placements, the global shape and
  stride). Everything that lays out, scatters, gathers and reduces rows takes it as any
  plain parameter (Note [row sharding] in engine/groups/layout.py): each dp group (one
  per tp coordinate) gathers and reduces rows of its own local tensor, and ``src_rank``
  is a rank of the dp group, so each tp coordinate takes its own local values from it.
- during compute the module sees the gathered local tensor as a DTensor on the tp mesh
  (:meth:`TpSpec.compute_form`, the parameter's ``Rows.full_of``), so that the parallel
  styles' hooks and DTensor's ops run unchanged. Its gradient, a DTensor on the tp
  mesh, is brought to the parameter's placements (the ``Partial`` gradient of a norm
  weight that ``SequenceParallel`` replicates is summed over tp there, as FSDP2 does) and
  its local tensor reduced over dp (:func:`local_grad`).
- what users and optimizers hold is a DTensor on the mesh that concatenates the dp mesh
  and the tp mesh (:meth:`TpSpec.shard_form`), placed (dp placement, tp placement): the
  dp rows are rows of the local tensor. When tp shards dim 0 too (``ColwiseParallel``),
  those are rows of a tp chunk, which DTensor writes ``_StridedShard(0,
  split_factor=tp)``, as FSDP2 does; ``full_tensor()`` is then the global weight (uneven
  rows included), and ``clip_grad_norm_`` over such gradients is the global norm.

``ShardedParam.shape`` is the local tensor's shape (what the group shards); the global
shape is the shard's (``TpSpec.shape``). Consolidation (``full_state_dict``,
``full_parameters``) gathers the local tensor over dp, then over tp
(:meth:`TpSpec.full_tensor`); a full tensor loaded with ``load_state_dict`` is cut to the
local tensor first (:meth:`TpSpec.local_of`). The reproducible mode sums each local
gradient exactly over the dp ranks, so its bits do not depend on dp; a tp size changes
each micro-batch's gradient (tp's own sums), so bits across tp sizes are not promised.
A checkpoint records ranges of each global tensor, as for any model (Note
[tensor-parallel checkpoints] in checkpoint/_tensor_parallel.py). What is not built yet
for such parameters is refused by name, at ``shard`` or at the entry point
(:func:`refuse`; docs/status.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..._registry import (
    PARAM,
    TENSOR_PARALLEL,
    TP_ORIGINAL,
    attach_to,
    attached,
    copy_user_attributes,
)
from ...errors import ShardwiseError


@dataclass(frozen=True)
class TpSpec:
    """Where a tensor-parallel parameter's local tensor sits in its global tensor: the tp
    ``mesh`` and ``placements`` torch's parallel style gave it, the global ``shape`` and
    ``stride`` (Note [tensor-parallel parameters])."""

    name: str
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def compute_form(self, local: torch.Tensor) -> DTensor:
        """``local`` (the gathered local tensor, a view of a group's full buffer) as the
        DTensor on the tp mesh that the module computes with."""
        with torch.no_grad():
            return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                      shape=self.shape, stride=self.stride)

    def shard_form(self, rows: torch.Tensor, dp_mesh: DeviceMesh,
                   dp_placements: tuple[Placement, ...]) -> DTensor:
        """``rows`` (this rank's rows of the local tensor) as the DTensor users hold: on
        the dp mesh's and the tp mesh's dims together, the dp placements first."""
        mesh = DeviceMesh._concatenate([dp_mesh, self.mesh])
        split = math.prod(self.mesh.size(i) for i, p in enumerate(self.placements)
                          if isinstance(p, Shard) and p.dim == 0)
        dp = tuple(_StridedShard(0, split_factor=split)
                   if split > 1 and type(p) is Shard and p.dim == 0 else p
                   for p in dp_placements)
        with torch.no_grad():
            return DTensor.from_local(rows, mesh, dp + self.placements, run_check=False,
                                      shape=self.shape, stride=self.stride)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor of a global tensor ``full`` (a view; tp divides every
        sharded dim: :func:`refusal`)."""
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard):
                full = full.chunk(self.mesh.size(i), dim=p.dim)[self.mesh.get_local_rank(i)]
        return full

    def full_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every tp rank's ``local`` (a collective over tp)."""
        return self.compute_form(local).full_tensor()


def tp_of(sp: Any) -> TpSpec | None:
    """The :class:`TpSpec` of a sharded parameter (a ``ShardedParam``), or ``None``."""
    return getattr(sp.gather, "tp", None)


def stand_in(name: str, p: nn.Parameter) -> nn.Parameter:
    """What the plan shards in place of parameter ``p``: ``p`` itself, or for a DTensor
    that is not already a shard, a plain parameter holding its local tensor and its
    :class:`TpSpec` (Note [tensor-parallel parameters]). Nothing is copied; ``shard``
    checks the spec against its mesh (:func:`refusal`)."""
    if not isinstance(p, DTensor) or attached(p, PARAM) is not None:
        return p
    local = p._local_tensor
    new = nn.Parameter(local, requires_grad=p.requires_grad)
    copy_user_attributes(p, new)
    attach_to(new, TENSOR_PARALLEL, TpSpec(name, p.device_mesh, tuple(p.placements),
                                           p.shape, tuple(p.stride())))
    attach_to(new, TP_ORIGINAL, p)  # retired with the stand-in: an optimizer may hold it
    return new


def refusal(spec: TpSpec, dp_mesh: DeviceMesh | None, local: torch.Tensor,
            head_dim: int | None = None) -> str | None:
    """Why a DTensor parameter cannot be sharded over ``dp_mesh`` (the mesh ``shard`` was
    given, ``None`` for a group), or ``None``. ``head_dim``: that of the attention module
    holding it, whose heads tp must divide, not only its rows."""
    where = f"{spec.name} is a DTensor on {spec.mesh} placed {list(spec.placements)}"
    if dp_mesh is None:
        return (f"{where}, and sw.shard was given a process group: tensor parallelism "
                f"composes with sharding over a sibling mesh. Build init_device_mesh(device, "
                f"(dp, tp), mesh_dim_names=('dp', 'tp')), parallelize over mesh['tp'] "
                f"and pass sw.shard(model, mesh=mesh['dp'])")
    if spec.mesh.ndim != 1:
        return (f"{where}: shardwise composes with 1-D tensor parallelism only "
                f"(a tp mesh of {spec.mesh.ndim} dimensions is not built)")
    bad = [p for p in spec.placements if type(p) not in (Shard, Replicate)]
    if bad:
        return (f"{where}: shardwise takes tensor-parallel placements Shard(d) and "
                f"Replicate() only, not {bad[0]}")
    if dp_mesh.mesh_dim_names is None or spec.mesh.mesh_dim_names is None:
        return (f"{where}: the data-parallel mesh and the tensor-parallel mesh must be "
                f"named dims of one mesh: init_device_mesh(device, (dp, tp), "
                f"mesh_dim_names=('dp', 'tp'))")
    try:
        DeviceMesh._concatenate([dp_mesh, spec.mesh])
    except RuntimeError as e:
        return (f"{where}, not a sibling of sw.shard's mesh {dp_mesh} ({e}): the tp mesh "
                f"and the dp mesh must be disjoint dims of one init_device_mesh, such as "
                f"mesh['tp'] and mesh['dp'] (or mesh['replicate', 'shard'])")
    if type(local.data) is not torch.Tensor:
        return (f"{where} whose local tensor is a {type(local.data).__name__}: shardwise "
                f"shards plain local tensors only")
    if local.is_meta or not local.is_contiguous():
        return (f"{where} with a {'meta' if local.is_meta else 'non-contiguous'} local "
                f"tensor: materialise it (contiguous) before sw.shard")
    size = spec.mesh.size()
    uneven = [p.dim for p in spec.placements
              if isinstance(p, Shard) and spec.shape[p.dim] % size]
    if uneven:
        return (f"{where}: tp={size} does not divide its dim {uneven[0]} (size "
                f"{spec.shape[uneven[0]]}), so tp ranks would hold local tensors of "
                f"different shapes. Choose a tp that divides it (for attention: the "
                f"number of heads)")
    split = [(p.dim, spec.shape[p.dim] // head_dim) for p in spec.placements
             if head_dim and isinstance(p, Shard) and spec.shape[p.dim] % head_dim == 0]
    heads = [(d, n) for d, n in split if n % size]
    if heads:
        return (f"{where}: tp={size} does not divide the {heads[0][1]} heads (head_dim "
                f"{head_dim}) its dim {heads[0][0]} holds, so a tp rank would hold part "
                f"of a head. Choose a tp that divides the number of heads (and of "
                f"key-value heads)")
    return None


def local_grad(grad: torch.Tensor | None, full: torch.Tensor) -> torch.Tensor | None:
    """A full parameter's gradient as the rows its group reduces: itself when plain; a
    tensor-parallel one's local tensor, in the parameter's placements (a ``Partial``
    gradient is reduced over tp first, a collective: Note [tensor-parallel parameters])."""
    if not isinstance(grad, DTensor):
        return grad
    assert isinstance(full, DTensor), "a DTensor gradient belongs to a tp parameter"
    if tuple(grad.placements) != tuple(full.placements):
        grad = grad.redistribute(full.device_mesh, full.placements)
    return grad._local_tensor


def refuse(params: Iterable[Any], what: str, why: str = "") -> None:
    """Raise a ``ShardwiseError`` naming ``what`` if any of ``params`` (sharded
    parameters) is tensor-parallel: an entry point not built for them yet. Every rank
    holds the same parameters, so every rank raises."""
    names = [p.fqns[0] for p in params if tp_of(p) is not None]
    if names:
        raise ShardwiseError(
            f"{what} does not take tensor-parallel parameters yet ({names[0]}"
            f"{', ...' if len(names) > 1 else ''}; docs/status.md){': ' + why if why else ''}")
