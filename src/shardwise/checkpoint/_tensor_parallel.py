"""Checkpoints of tensor-parallel models, in the format every checkpoint has (Note
[tensor-parallel checkpoints]).

Note [tensor-parallel checkpoints]
A checkpoint records, per parameter, one ``(offset, count)`` range of the flattened
*global* tensor per rank, the ranks' ranges tiling it (Note [metadata that cannot lie] in
_schema.py); a load assembles any range from them (``VerifiedCheckpoint.assemble``). A
tensor-parallel model (Note [tensor-parallel parameters] in
engine/groups/tensor_parallel.py) keeps that format, so that its checkpoints load into
a model at any other ``(dp, tp)``, or without tensor parallelism, and the other way
round, and ``shardwise consolidate`` and verification read them unchanged:

- the checkpoint spans every rank of the dp and tp meshes together (:func:`checkpoint_comm`,
  their flattened mesh), not the model's dp group alone: each rank writes its own file.
- a rank holds rows ``[r0, r1)`` of its local tensor (Note [row sharding] in
  engine/groups/layout.py). Where tp shards dim 0 (``ColwiseParallel``) they are one
  contiguous range of the global tensor, which the rank saves as it is ("chunk").
- where tp shards another dim ``d`` (``RowwiseParallel``: dim 1), the tp ranks of one dp
  coordinate hold the same rows, each a block of columns, and no rank's elements are a
  range of the global tensor; but together they are the global rows ``[r0, r1)``, one
  range. At save the tp ranks all-gather their blocks and each keeps the ``k``-th of
  ``tp`` equal parts of that range ("gather"): as many elements as it holds. At load a
  rank reads the global rows ``[r0, r1)`` and keeps its block of dim ``d``: ``tp`` times
  the elements it needs, one parameter at a time.
- where tp replicates the parameter (``SequenceParallel``'s norms, and every parameter
  tensor parallelism leaves alone), every tp rank holds the same rows: each saves the
  ``k``-th of ``tp`` parts of its rows' range ("split"), and reads its rows as they are.

The optimizer state shaped like a parameter is cut as the parameter is. The exchange of
the "gather" case is the one collective a save adds; it runs after every rank has checked
what it saves (Note [agreed failure] in comm/agree.py), in the call, so that a background
save's thread never uses the training's tp group. It costs a copy of this rank's rows of
each such parameter and of their optimizer state until the file is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..comm.collectives import Comm
from ..engine.groups.tensor_parallel import TpSpec, tp_of
from ..engine.iteration.unit import sharded_param
from ..errors import ShardwiseError

# A flat range ``(offset, count)`` of a tensor read from a checkpoint or a source.
Read = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True)
class TpPlace:
    """A sharded parameter of a tensor-parallel model, as a checkpoint cuts it: the tp
    ``size`` and this rank's tp ``rank``, the parameter's ``spec`` (``None`` for one tp
    does not split), its local tensor's ``local_shape`` (Note [tensor-parallel
    checkpoints])."""

    size: int
    rank: int
    spec: TpSpec | None
    local_shape: tuple[int, ...]

    @property
    def dim(self) -> int | None:
        """The dim tp shards, or ``None`` where it replicates the parameter."""
        if self.spec is None:
            return None
        dims = [p.dim for p in self.spec.placements if isinstance(p, Shard)]
        return dims[0] if dims else None

    def _rows(self, lo: int, n: int) -> tuple[int, int, int]:
        """(first row, rows, elements of a global row) of the local range ``lo, n``."""
        row = math.prod(self.local_shape[1:])
        full_row = row * (self.size if self.dim not in (None, 0) else 1)
        return lo // row, n // row, full_row

    def saved_range(self, lo: int, n: int) -> tuple[int, int]:
        """The range of the global tensor this rank saves of the local range ``lo, n``."""
        if self.dim == 0:
            return self.rank * math.prod(self.local_shape) + lo, n
        if self.dim is None:
            part = -(-n // self.size)
            start = min(self.rank * part, n)
            return lo + start, min(start + part, n) - start
        first, _, full_row = self._rows(lo, n)
        return first * full_row + self.rank * n, n

    def saved_values(self, rows: torch.Tensor, lo: int, n: int) -> torch.Tensor:
        """What this rank saves of its ``rows`` (the flat local range ``lo, n``): a view,
        or for a dim other than 0 the exchange over tp (a collective; every tp rank
        calls it for the same parameters in the same order)."""
        if self.dim == 0:
            return rows
        start, count = self.saved_range(lo, n)
        if self.dim is None:
            return rows[start - lo:start - lo + count]
        assert self.spec is not None
        if n == 0:  # a dp rank without rows: so are its tp peers
            return rows
        group = self.spec.mesh.get_group()
        # A background save stages its rows in host memory; NCCL takes device tensors.
        on = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else rows.device)
        block = rows.detach().reshape(-1, *self.local_shape[1:]).to(on).contiguous()
        gathered = [torch.empty_like(block) for _ in range(self.size)]
        dist.all_gather(gathered, block, group=group)
        whole = torch.cat(gathered, dim=self.dim).reshape(-1)
        del gathered
        # A copy of this rank's part alone: a view would keep all tp ranks' rows alive
        # until the save is written.
        return whole[self.rank * n:(self.rank + 1) * n].to(rows.device, copy=True)

    def read_local(self, read: Read, lo: int, n: int) -> torch.Tensor:
        """This rank's local range ``lo, n`` from a reader of global ranges."""
        if self.dim is None:
            return read(lo, n)
        if self.dim == 0:
            return read(self.rank * math.prod(self.local_shape) + lo, n)
        first, rows, full_row = self._rows(lo, n)
        assert self.spec is not None
        block = read(first * full_row, rows * full_row).view(rows, *self.spec.shape[1:])
        width = self.local_shape[self.dim]
        return block.narrow(self.dim, self.rank * width, width).contiguous().view(-1)


def tp_places(records: list) -> dict[int, TpPlace]:
    """Each sharded parameter (a ``ShardedParam``) of a tensor-parallel model by ``id``,
    with its :class:`TpPlace`; empty for a model without tensor parallelism."""
    specs = [spec for sp in records if (spec := tp_of(sp)) is not None]
    if not specs:
        return {}
    mesh = specs[0].mesh
    return {id(sp): TpPlace(mesh.size(), mesh.get_local_rank(), tp_of(sp), tuple(sp.shape))
            for sp in records if sp.by_rows}


def checkpoint_comm(module: nn.Module, comm: Comm | None) -> Comm | None:
    """The ranks a checkpoint of ``module`` spans: its group ``comm``, or for a
    tensor-parallel model every rank of its dp and tp meshes (their flattened mesh,
    which torch makes at the first call, a collective over them, and keeps).

    Raises:
        ShardwiseError: the model's tensor-parallel parameters are on different meshes.
    """
    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    for p in module.parameters():
        sp = sharded_param(p)
        if sp is not None and tp_of(sp) is not None:
            assert isinstance(sp.shard, DTensor), "a tp parameter's shard is a DTensor"
            mesh = sp.shard.device_mesh  # the dp and tp meshes concatenated
            meshes.setdefault(tuple(mesh.mesh.flatten().tolist()), mesh)
    if not meshes:
        return comm
    if len(meshes) > 1 or len({p.mesh for p in _specs(module)}) > 1:
        raise ShardwiseError(
            "a checkpoint of a tensor-parallel model takes one tp mesh for all its "
            "parameters; this model's are on several")
    mesh = next(iter(meshes.values()))
    return Comm(mesh._flatten().get_group())


def _specs(module: nn.Module) -> list[TpSpec]:
    return [spec for p in module.parameters()
            if (sp := sharded_param(p)) is not None and (spec := tp_of(sp)) is not None]
