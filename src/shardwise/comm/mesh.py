"""Where a sharded model's ranks sit: who shards a parameter, who holds the same shard.

Note [hybrid sharding]
``sw.shard(model, mesh=mesh)`` with a 2-D ``DeviceMesh`` whose dims are (replicate,
shard), as FSDP2's ``fully_shard(mesh=...)`` takes it: each parameter is sharded over the
S ranks of a shard group (one row of the mesh, typically the GPUs of one node) and
replicated over the R rows. Three groups then do three jobs (:class:`Topology`):

- ``shard``: a unit's all-gathers and gradient reduce-scatters, over S ranks, so that
  they stay on a node's fast links; the layout, a rank's rows and its file pieces follow
  the rank's place in this group;
- ``replicate``: after a unit's reduce-scatter, its gradient shard is summed across the
  R replicas holding the same rows (``engine/groups/reduce.py``): the only bulk traffic between
  nodes, P/S elements per step, and none inside ``no_sync``, which defers both;
- ``world``: every rank of the mesh, for what must hold everywhere: buffers (broadcast
  from ``src_rank``), the collective-order check, agreement on errors, ``gathered()``'s
  modifier rank, the used-parameter flags and the checkpoint's protocol (per step: a
  few all-reduces of tens of bytes, which also cross nodes). ``src_rank``
  and ``modifier_rank`` are ranks of this group (the global rank, when the mesh spans the
  world).

Gradients are scaled by 1/(R*S) as they are copied in, then summed over S and over R:
the DDP average over the same R*S ranks, summed in another order (R=S=2:
(a+b)+(c+d) against gloo's ring), so equal to DDP within the last bits, not bit for bit.
Parameters are ``DTensor``s placed ``(Replicate(), Shard(0))`` on the user's mesh, so
``clip_grad_norm_`` and ``state_dict()`` keep their meaning (a norm reduces over the shard
dim only). A checkpoint holds each shard once: only replica 0 writes parameter and
optimizer rows (the other replicas' files record empty pieces), so it loads at any
layout, flat or hybrid. A 1-D mesh is the same as ``group=mesh.get_group()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..errors import ShardwiseError
from .collectives import Comm
from .scalars import mark


@dataclass
class Topology:
    """The groups of one sharded model (Note [hybrid sharding]); flat ZeRO-3 has
    ``shard is world`` and no ``replicate``."""

    world: Comm
    shard: Comm
    replicate: Comm | None
    mesh: DeviceMesh  # the DTensor parameters' mesh
    placements: tuple[Placement, ...]
    # The mesh ``shard`` was given, 1-D or 2-D (``None`` for a group): tensor-parallel
    # parameters' sibling (Note [tensor-parallel parameters] in
    # engine/groups/tensor_parallel.py).
    given: DeviceMesh | None = None

    def __post_init__(self) -> None:
        # One stream of order checks over every rank of the model (Note [checks ride
        # the exchanges]), whichever subgroup an exchange travels in.
        for comm in (self.shard, self.replicate):
            if comm is not None:
                comm.checks_over = self.world

    @property
    def replicas(self) -> int:
        """R: how many ranks hold each shard."""
        return 1 if self.replicate is None else self.replicate.world_size

    @property
    def replica_index(self) -> int:
        """This rank's replica (row of the mesh); 0 when flat."""
        return 0 if self.replicate is None else self.replicate.rank

    def source(self, src_rank: int) -> tuple[int, int]:
        """(replica index, shard rank) of the world rank ``src_rank``."""
        if self.replicate is None:
            return 0, src_rank
        target = self.world.global_rank(src_rank)
        rows = self.mesh.mesh.tolist()
        for i, row in enumerate(rows):
            if target in row:
                return i, row.index(target)
        raise ShardwiseError(f"internal: rank {src_rank} is not in the mesh {rows}")


def topology(group: dist.ProcessGroup | None, mesh: DeviceMesh | None) -> Topology:
    """The groups for ``shard(group=, mesh=)``; raises ``ShardwiseError`` on a bad mesh."""
    if mesh is not None and group is not None:
        raise ShardwiseError("pass group= or mesh= to sw.shard, not both: a 1-D mesh is the "
                             "same as group=mesh.get_group()")
    if mesh is None:
        comm = Comm(group)
        return Topology(comm, comm, None, comm.mesh(), (Shard(0),))
    if not isinstance(mesh, DeviceMesh):
        raise ShardwiseError(f"mesh={mesh!r} is not a torch.distributed.device_mesh."
                             f"DeviceMesh: build one with init_device_mesh(device, (R, S))")
    if mesh.ndim == 1:
        flat = topology(mesh.get_group(), None)
        flat.given = mesh
        return flat
    if mesh.ndim != 2:
        raise ShardwiseError(f"mesh has {mesh.ndim} dimensions; sw.shard takes a 1-D mesh "
                             f"(flat sharding) or a 2-D one, dims (replicate, shard)")
    if mesh.get_coordinate() is None:
        raise ShardwiseError(f"this rank ({dist.get_rank()}) is not in the mesh "
                             f"{mesh.mesh.tolist()}: every rank that calls sw.shard must be")
    shard, replicate = Comm(mesh.get_group(1)), Comm(mesh.get_group(0))
    # The layout's row ranges follow the rank's place in the shard group; DTensor's
    # Shard(0) follows its mesh coordinate: they must be the same order.
    if shard.rank != mesh.get_local_rank(1) or replicate.rank != mesh.get_local_rank(0):
        raise ShardwiseError(f"the mesh {mesh.mesh.tolist()} orders ranks differently from "
                             f"its process groups; build it with init_device_mesh or with "
                             f"ranks increasing along each dimension")
    world = _world(mesh, shard, replicate)
    mark(mesh)  # Note [rank-local scalars] in comm/scalars.py
    return Topology(world, shard, replicate, mesh, (Replicate(), Shard(0)), mesh)


def _world(mesh: DeviceMesh, shard: Comm, replicate: Comm) -> Comm:
    """A group over every rank of ``mesh``: the default group, or one of the mesh's own
    when a dimension has size 1. A mesh over part of the world with both dimensions
    above 1 would need a new group that only its ranks create, which torch cannot make
    reliably while other ranks create theirs."""
    if mesh.size() == dist.get_world_size():
        return Comm(None)
    if replicate.world_size == 1:
        return shard
    if shard.world_size == 1:
        return replicate
    if mesh.mesh_dim_names is not None and mesh._get_root_mesh() is not mesh:
        # Dims of a larger named mesh (mesh["replicate", "shard"] of a 3-D mesh whose
        # third dim is tensor-parallel): torch's flattening makes every such group, each
        # rank of the root taking part, as every rank calls shard.
        return Comm(mesh._flatten().get_group())
    raise ShardwiseError(
        f"the mesh {mesh.mesh.tolist()} spans {mesh.size()} of the "
        f"{dist.get_world_size()} ranks with both dimensions above 1; hybrid sharding "
        f"takes a mesh over the whole world (or over part of it with one dimension of "
        f"size 1)")


# Note [secondary shards]
# ``reshard_after_forward=k`` (k dividing the shard group's size S, 1 < k < S): between a
# unit's forward and its backward, its parameters stay sharded over groups of k
# contiguous ranks of the shard group (within a node, when nodes hold k or more ranks)
# instead of over all S. At the forward's gather each rank keeps part j of the gathered
# (rank-major) buffer, j being its place in its group of k; the backward gathers the k
# parts within that group, which rebuilds the same buffer, so every value, and therefore
# every loss, equals ZeRO-3's bit for bit (DeepSpeed's hpZ once did not). A unit holds
# 1/k of its parameters from forward to backward (ZeRO-3: 1/S, ``False``: all), and its
# backward all-gather sends (k-1)/k of the unit within the group instead of (S-1)/S
# across the shard group. If the shard changed in between (an optimizer step between a
# forward and its backward), the kept part is stale and the backward gathers over the
# shard group as usual.
def check_secondary(topo: Topology, k: object) -> None:
    """Raise ``ShardwiseError`` unless ``reshard_after_forward=k`` can be honoured: a
    bool, or an int dividing the shard group's size, over a model spanning the world."""
    if isinstance(k, bool):
        return
    if type(k) is not int:
        raise ShardwiseError(f"reshard_after_forward={k!r}: expected True, False or an int")
    size = topo.shard.world_size
    if k == size:
        return  # groups of S ranks are the shard group: ZeRO-3 itself
    if k < 2 or k > size or size % k:
        raise ShardwiseError(
            f"reshard_after_forward={k}: an integer must divide the shard group's size "
            f"({size}) and be at least 2: the parameters then stay "
            f"sharded over groups of k ranks between forward and backward. Pass True "
            f"(ZeRO-3) or False (keep them gathered) otherwise")
    if topo.world.world_size != dist.get_world_size():
        raise ShardwiseError(
            f"reshard_after_forward={k} needs the model's ranks to be the whole world "
            f"(every rank creates the groups of {k}); this model's group or mesh spans "
            f"{topo.world.world_size} of {dist.get_world_size()} ranks")


def secondary_groups(topo: Topology, k: int) -> Comm:
    """This rank's group of k contiguous ranks of its shard group (Note [secondary
    shards]). Every rank creates every such group, in mesh order (:func:`check_secondary`
    says when that is possible)."""
    rows = (topo.mesh.mesh.tolist() if topo.replicate is not None
            else [list(range(dist.get_world_size()))])
    me = dist.get_rank()
    mine = None
    for row in rows:
        for start in range(0, len(row), k):
            block = cast(list[int], row[start:start + k])
            group = dist.new_group(block)
            if me in block:
                mine = group
    assert mine is not None, "every rank is in its shard group's row"
    comm = Comm(mine)
    comm.checks_over = topo.world
    return comm
