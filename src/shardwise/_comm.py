"""Collectives over one process group, with byte counters.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single``, which older releases lack: the newer name
is used where it exists, so no deprecation warning is raised on any release.

Collectives write only into buffers of their own (the all-gather output is a temporary
that is copied out, Note [freeing full parameters] in _unit.py), never into tensors
autograd has saved: gloo bumps an output's version counter on its worker thread, at a
moment nobody can wait for.

Note [stuck collectives]: every collective carries a description of what it is for
("the all-gather of unit 'blocks.3'"). When it fails, because a peer died or because no
peer joined it before the process group's timeout (ranks that diverged), the error names
that collective and this rank, so that a hang ends in a message saying where each rank
was waiting, not in an anonymous gloo timeout.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import CollectiveError

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

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                   what: str = "an all-gather"):
        """Concatenate every rank's ``inp`` into ``out``."""
        self.stats.add("all_gather", inp)
        return self._run(what, async_op, _all_gather_flat, out, inp)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                       what: str = "a reduce-scatter"):
        """Sum ``inp`` over ranks and keep this rank's chunk in ``out``.

        ``inp`` is consumed: under gloo it is overwritten with the sum. gloo has no
        reduce-scatter: torch implements it by cloning the input, all-reducing the clone
        and copying one chunk out. Doing the same on ``inp`` itself gives the same bits
        and the same traffic without the clone, a unit-sized buffer at every reduction.
        """
        self.stats.add("reduce_scatter", inp)
        if "gloo" not in self.backend:
            return self._run(what, async_op, _reduce_scatter_flat, out, inp)
        work = self._run(what, True, dist.all_reduce, inp)
        pending = _ChunkOut(work, out, inp, self.rank, self.world_size)
        if not async_op:
            pending.wait()
            return None
        return pending

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   what: str = "an all-reduce"):
        self.stats.add("all_reduce", tensor)
        return self._run(what, async_op, dist.all_reduce, tensor, op=op)

    def scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None, src: int,
                what: str = "a scatter") -> None:
        """Rank ``src`` sends ``chunks[r]`` to rank r (``chunks`` is ignored elsewhere)."""
        self.stats.add("scatter", out)
        self._run(what, False, dist.scatter, out, chunks if self.rank == src else None,
                  src=self.global_rank(src))

    def broadcast(self, tensor: torch.Tensor, src: int, what: str = "a broadcast") -> None:
        self.stats.add("broadcast", tensor)
        self._run(what, False, dist.broadcast, tensor, src=self.global_rank(src))

    def _run(self, what: str, async_op: bool, collective, *args, **kwargs):
        """Issue ``collective``; Note [stuck collectives] for the errors."""
        try:
            work = collective(*args, group=self.group, async_op=async_op, **kwargs)
        except RuntimeError as err:
            raise self.stuck(what, err) from err
        return _Pending(work, self, what) if async_op else None

    def stuck(self, what: str, err: BaseException) -> CollectiveError:
        """The error for ``what``, which failed on this rank with ``err``."""
        return CollectiveError(
            f"rank {self.rank}: {what} did not complete ({err}). Another rank failed or "
            f"never joined it within the process group's timeout: look for another rank's "
            f"error first. If none raised, the ranks diverged (ran different code, or one "
            f"stopped early); rerun with SHARDWISE_CHECK=1 to see where. The timeout is "
            f"sw.init_distributed(timeout=...)")

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int,
                          what: str = "a broadcast") -> None:
        """Make every rank's ``tensors`` equal to rank ``src``'s, one message per dtype.

        Tensors are updated in place, and only on ranks other than ``src``.
        """
        for same_dtype in _by_dtype(tensors).values():
            flat = _flatten(same_dtype)
            self.broadcast(flat, src, what)
            if self.rank != src:
                _unflatten_into(flat, same_dtype)

    def average_tensors(self, tensors: list[torch.Tensor],
                        what: str = "an all-reduce") -> None:
        """Replace floating ``tensors`` in place by their mean over ranks."""
        for same_dtype in _by_dtype(tensors).values():
            flat = _flatten(same_dtype)
            self.all_reduce(flat, what=what)
            flat.div_(self.world_size)
            _unflatten_into(flat, same_dtype)

    def all_gather_object(self, obj: Any, what: str = "an exchange of metadata") -> list[Any]:
        """Every rank's ``obj``, in rank order (small metadata only)."""
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as err:
            raise self.stuck(what, err) from err
        return out


class _ChunkOut:
    """An all-reduce whose ``wait`` also copies this rank's chunk of the sum out."""

    def __init__(self, work: Any, out: torch.Tensor, summed: torch.Tensor, rank: int,
                 world_size: int) -> None:
        self._work = work
        self._out: torch.Tensor | None = out
        self._summed = summed
        self._rank = rank
        self._world_size = world_size

    def wait(self) -> None:
        self._work.wait()
        if self._out is not None:
            self._out.copy_(self._summed.chunk(self._world_size)[self._rank])
            self._out = None
            del self._summed  # the caller drops its own reference after the wait


class _Pending:
    """An issued collective, whose ``wait`` names it when it fails."""

    def __init__(self, work: Any, comm: Comm, what: str) -> None:
        self._work = work
        self._comm = comm
        self._what = what

    def wait(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as err:
            raise self._comm.stuck(self._what, err) from err


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
