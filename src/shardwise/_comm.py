"""Collectives over one process group, with byte counters.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single``, which older releases lack: the newer name
is used where it exists, so no deprecation warning is raised on any release.

Collectives write only into buffers of their own (the all-gather output is a temporary
that is copied out, Note [freeing full parameters] in _unit.py), never into tensors
autograd has saved: gloo bumps an output's version counter on its worker thread, at a
moment nobody can wait for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# gloo cannot send bool; these travel as the same-size integer.
_WIRE_DTYPE = {torch.bool: torch.uint8}


@dataclass
class CommStats:
    """Bytes sent into each kind of collective (this rank's input), and call counts."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1


class Comm:
    """One process group, this rank's place in it, and what was sent over it."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = CommStats()
        self.backend = str(dist.get_backend(group))
        self._mesh = None

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors (NCCL: the current GPU)."""
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def mesh(self):
        """A 1-D ``DeviceMesh`` over this group, for DTensor parameters (made once)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = self.group if self.group is not None else dist.group.WORLD
            mesh = DeviceMesh.from_group(group, self.device.type)
            # Note [teardown] in distributed.py: a mesh keeps its group in _pg_registry,
            # which would keep gloo's threads alive past destroy_process_group for as long
            # as the model lives (to interpreter exit, for a model in a global). Eager
            # DTensor ops find the group by name; only torch.compile tracing reads the
            # registry.
            mesh._pg_registry.clear()
            self._mesh = mesh
        return self._mesh

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of ``group_rank`` in this group."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's ``inp`` into ``out``."""
        self.stats.add("all_gather", inp)
        return _all_gather_flat(out, inp, group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Sum ``inp`` over ranks and keep this rank's chunk in ``out``."""
        self.stats.add("reduce_scatter", inp)
        return _reduce_scatter_flat(out, inp, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        self.stats.add("all_reduce", tensor)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None, src: int) -> None:
        """Rank ``src`` sends ``chunks[r]`` to rank r (``chunks`` is ignored elsewhere)."""
        self.stats.add("scatter", out)
        dist.scatter(out, chunks if self.rank == src else None, src=self.global_rank(src),
                     group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.stats.add("broadcast", tensor)
        dist.broadcast(tensor, src=self.global_rank(src), group=self.group)

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> None:
        """Make every rank's ``tensors`` equal to rank ``src``'s, one message per dtype.

        Tensors are updated in place, and only on ranks other than ``src``.
        """
        for same_dtype in _by_dtype(tensors).values():
            flat = _flatten(same_dtype)
            self.broadcast(flat, src)
            if self.rank != src:
                _unflatten_into(flat, same_dtype)

    def average_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Replace floating ``tensors`` in place by their mean over ranks."""
        for same_dtype in _by_dtype(tensors).values():
            flat = _flatten(same_dtype)
            self.all_reduce(flat)
            flat.div_(self.world_size)
            _unflatten_into(flat, same_dtype)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (small metadata only)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _by_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    wire = _WIRE_DTYPE.get(tensors[0].dtype, tensors[0].dtype)
    return torch.cat([t.detach().reshape(-1).view(wire) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.dtype).view(t.shape))
            offset += n
