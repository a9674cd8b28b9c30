"""Gradient reduction of one flat group: copy-in, reduce-scatter, gradient shards.

After a unit's backward, each full parameter's gradient is written, scaled by 1/N, into
a rank-major buffer (``engine/groups/copies.py``) and reduce-scattered asynchronously (in a world of
one the buffer is the result); when backward ends, each rank's rows become the DTensor
parameters' ``.grad``. Inside ``no_sync`` the buffer keeps accumulating instead, and the
first synchronised backward reduces the sum. Under hybrid sharding (Note [hybrid
sharding] in comm/mesh.py) the reduced shard is then summed across the replicas holding the
same rows, also asynchronously: ``advance`` starts that sum as soon as the reduce-scatter
is done, so it overlaps the backward of the units that follow, as the reduce-scatter does.
The reproducible mode's reduction is
:class:`~shardwise.engine.groups.exact_reduction.ExactReduction`, a subclass: this module is the
default path only.
"""

from __future__ import annotations

import enum
import math
from typing import Any, ClassVar, Protocol

import torch
from torch.distributed.tensor import DTensor

from ...comm.collectives import Comm
from ...errors import ShardwiseError
from .copies import rank_major, row_regions, write_rank_major
from .layout import ShardLayout
from .tensor_parallel import local_grad


class Group(Protocol):
    """What a reduction needs of its :class:`~shardwise.engine.groups.flat.FlatGroup` (which owns
    it; engine/groups/flat.py imports this module, not the other way round)."""

    params: list[Any]  # the group's ShardedParams: .full, .shard, .local, .slot, .as_dtensor
    layout: ShardLayout
    gaps: Any
    dtype: torch.dtype

    @property
    def reduce_dtype(self) -> torch.dtype: ...

    @property
    def local(self) -> torch.Tensor: ...

    device: torch.device  # where reductions run (``local`` may be offloaded)
    # Where the shard lives (engine/groups/parts.py's ShardStorage): parks reduced rows
    # until they are published, and drops an offloaded group's pages.
    storage: Any
    comm: Comm
    replicate: Comm | None
    unit_name: str

    def publish_grad(self, p: Any, rows: torch.Tensor) -> None: ...

    @property
    def data_parallel_size(self) -> int: ...


class Reduction(enum.Enum):
    """Where a group's gradients are between backward passes.

    ``IDLE`` -> (``start``, ``no_sync``) ``ACCUMULATING`` -> ... -> (``start``, synced)
    ``REDUCING`` -> (``wait``) ``REDUCED`` -> (``finish``) ``IDLE``; under hybrid sharding
    ``REDUCING`` -> (``advance``) ``REPLICATING`` -> (``wait``) ``REDUCED``. In a world of
    one a synced ``start`` goes straight to ``REDUCED``: the buffer is the sum. ``drop`` (an
    aborted backward) goes back to ``IDLE`` from ``REDUCING``, ``REPLICATING`` or
    ``REDUCED``, and keeps what earlier ``no_sync`` passes accumulated.
    """

    IDLE = "idle"                    # nothing held
    ACCUMULATING = "accumulating"    # _buf (exact mode: _acc): gradients summed under no_sync
    REDUCING = "reducing"            # _buf in flight to _out (_work, or the exact exchange)
    REPLICATING = "replicating"      # _out summed across replicas in place (_work pending)
    REDUCED = "reduced"              # _out: this rank's reduced rows, to publish


_ALLOWED = {
    Reduction.IDLE: {Reduction.ACCUMULATING, Reduction.REDUCING, Reduction.REPLICATING,
                     Reduction.REDUCED},
    Reduction.ACCUMULATING: {Reduction.ACCUMULATING, Reduction.REDUCING,
                             Reduction.REPLICATING, Reduction.REDUCED,
                             Reduction.IDLE},  # every accumulated gradient cleared
    Reduction.REDUCING: {Reduction.REPLICATING, Reduction.REDUCED, Reduction.IDLE},
    Reduction.REPLICATING: {Reduction.REDUCED, Reduction.IDLE},
    Reduction.REDUCED: {Reduction.IDLE},
}


class GradReduction:
    """The gradient side of a :class:`~shardwise.engine.groups.flat.FlatGroup` (states:
    Reduction)."""

    exact: ClassVar[bool] = False  # the reproducible mode's (engine/groups/exact_reduction.py)
    # Every backward is a micro-batch of the step's mean, so every unit joins every
    # reduction, with a zero term if it computed nothing (the reproducible mode's).
    reduces_every_backward: ClassVar[bool] = False

    def __init__(self, group: Group) -> None:
        self.group = group
        self.used = [False] * len(group.params)  # had a local gradient since the last sync
        self.state = Reduction.IDLE
        self._buf: torch.Tensor | None = None   # ACCUMULATING, REDUCING
        self._out: torch.Tensor | None = None   # REDUCING, REDUCED
        self._work = None                       # REDUCING

    def _move(self, to: Reduction) -> None:
        if to not in _ALLOWED[self.state]:
            raise ShardwiseError(f"internal: the gradient reduction of unit "
                                 f"{self.group.unit_name!r} cannot go from {self.state.value} "
                                 f"to {to.value}; please report this with your model")
        self.state = to

    def start(self, sync: bool) -> None:
        """Move the full gradients into the reduction buffer; reduce-scatter if ``sync``.

        Outside ``no_sync`` the gradients are scaled by 1/N while copied, then summed, as
        DistributedDataParallel does, so results match it bit for bit at N=2.
        """
        g = self.group
        accumulating = self.state is Reduction.ACCUMULATING
        buf = self._buf if accumulating else None
        if buf is None:
            buf = rank_major(g.layout, g.gaps, g.reduce_dtype, g.device)
        with torch.no_grad():
            for i, p in enumerate(g.params):
                grad = p.full.grad
                if isinstance(grad, DTensor):  # Note [tensor-parallel parameters]
                    grad = local_grad(grad, p.full)
                p.full.grad = None
                self._take(buf, i, grad, seen=self.used[i] and accumulating, sync=sync)
                self.used[i] |= grad is not None
        if not sync:
            self._move(Reduction.ACCUMULATING)
            self._buf = buf
            return
        if g.comm.world_size == 1:
            self._buf, self._out = None, buf  # the sum over one rank, in this rank's layout
            if g.replicate is None:
                self._reduced()
            else:
                self._replicate()
            return
        self._move(Reduction.REDUCING)
        self._buf = buf
        self._out = torch.empty(g.layout.shard_numel, dtype=g.reduce_dtype,
                                device=g.device)
        self._work = g.comm.reduce_scatter(
            self._out, buf, async_op=True,
            what=f"the reduce-scatter of unit {g.unit_name!r}'s gradients")

    def _take(self, buf: torch.Tensor, i: int, grad: torch.Tensor | None, seen: bool,
              sync: bool) -> None:
        """Parameter ``i``'s part of :meth:`start`. ``seen``: ``buf`` already holds its
        gradients from earlier ``no_sync`` backward passes."""
        g = self.group
        slot = g.layout.slots[i]
        inv_n = 1.0 / g.data_parallel_size
        if grad is None and not seen:
            write_rank_major(buf, g.layout, slot, torch.zeros(()).expand(slot.shape))
        elif grad is not None and seen:
            write_rank_major(buf, g.layout, slot, grad, lambda d, s: d.add_(s))
        elif grad is not None and sync:
            write_rank_major(buf, g.layout, slot, grad, lambda d, s: torch.mul(s, inv_n, out=d))
        elif grad is not None:
            write_rank_major(buf, g.layout, slot, grad)
        if seen and sync:  # accumulated micro-batches: scale the sum once
            for region, _ in row_regions(buf, g.layout, slot):
                region.mul_(inv_n)

    def clear_refusal(self, which: list[int]) -> str | None:
        """Why :meth:`clear` may not clear only ``which`` (the default: it always may)."""
        return None

    def clear(self, which: list[int]) -> None:
        """``zero_grad`` reached the parameters at ``which``: forget what ``no_sync``
        backward passes accumulated for them, as DDP's ``zero_grad`` clears its local
        ``.grad`` (Note [zero_grad reaches held gradients] in engine/entry_points/zero_grad.py).
        Their rows in the buffer become zeros and they count as unused, so the next backward
        writes its gradient there instead of adding to it."""
        if self.state is not Reduction.ACCUMULATING:
            return
        assert self._buf is not None
        g = self.group
        with torch.no_grad():
            for i in which:
                if self.used[i]:
                    write_rank_major(self._buf, g.layout, g.layout.slots[i],
                                     torch.zeros(()).expand(g.layout.slots[i].shape))
                    self.used[i] = False
        if not any(self.used):
            self._buf = None
            self._move(Reduction.IDLE)

    def has_accumulated(self) -> bool:
        """Whether gradients accumulated under ``no_sync`` await their reduction."""
        return self.state is Reduction.ACCUMULATING

    def holds_partial_step(self) -> bool:
        """Whether it holds part of a step that a copy or a checkpoint would miss (the
        default: never; ``no_sync`` gradients are the user's to finish)."""
        return False

    def cast_refusal(self) -> str | None:
        """Why the group cannot be cast to another dtype (Note [casting after shard]),
        or ``None``."""
        return None

    def in_flight(self) -> bool:
        """Whether a reduction was started and not waited for yet (by the model's schedule,
        Note [communication owner] in engine/iteration/state.py)."""
        return self.state in (Reduction.REDUCING, Reduction.REPLICATING)

    def advance(self) -> None:
        """Wait for an in-flight reduce-scatter; under hybrid sharding, start the sum
        across replicas without waiting for it."""
        if self.state is Reduction.REDUCING:
            assert self._work is not None
            self._work.wait()
            self._work = self._buf = None
            if self.group.replicate is None:
                self._reduced()
            else:
                self._replicate()

    def wait(self) -> None:
        """Wait until this rank's reduced rows are complete (nothing to do in other
        states)."""
        self.advance()
        if self.state is Reduction.REPLICATING:
            assert self._work is not None
            self._work.wait()
            self._work = None
            self._reduced()

    def _reduced(self) -> None:
        """-> REDUCED. An offloaded group's reduced rows wait on the optimizer's tier
        (its storage parks them; on disk in the gradients' file when it may, Note
        [reduced rows written once] in engine/groups/offload/storage.py), so that a
        backward's worth of them never piles up on the device (or, for the disk tier, in
        memory) before they are published."""
        self._move(Reduction.REDUCED)
        if self._out is not None:
            self._out = self.group.storage.park(self._out, self.group.params)

    def _replicate(self) -> None:
        g = self.group
        assert g.replicate is not None and self._out is not None
        self._move(Reduction.REPLICATING)
        self._work = g.replicate.all_reduce(
            self._out, async_op=True,
            what=f"the all-reduce of unit {g.unit_name!r}'s gradients across replicas")

    def drop(self) -> None:
        """Forget an unfinished reduction (its backward was aborted); what earlier
        ``no_sync`` passes accumulated stays. Communication in flight is waited for (its
        buffers must outlive it) but nothing new starts: no sum across replicas of a
        result that is thrown away."""
        if self.state in (Reduction.REDUCING, Reduction.REPLICATING):
            if self._work is not None:
                self._work.discard()
            self._work = self._buf = None
            self._move(Reduction.IDLE)
        elif self.state is Reduction.REDUCED:
            self._move(Reduction.IDLE)
        self._out = None

    def finish(self, used_anywhere: list[bool]) -> None:
        """Accumulate the reduced rows into each parameter's DTensor ``.grad``, once the
        model's schedule waited for them (:meth:`wait`; Note [communication owner] in
        engine/iteration/state.py).

        A parameter no rank computed a gradient for keeps its ``.grad`` untouched, as under
        DistributedDataParallel with ``find_unused_parameters=True``.
        """
        if self.in_flight():
            raise ShardwiseError(f"internal: the gradients of unit {self.group.unit_name!r} "
                                 f"were to be published before their reduction was waited "
                                 f"for; please report this with your model")
        if self.state is not Reduction.REDUCED:
            return
        self._move(Reduction.IDLE)
        out, self._out = self._out, None
        assert out is not None
        g = self.group
        self._before_publishing(used_anywhere)
        if out.dtype != g.dtype:
            out = out.to(g.dtype)
        for i, p in enumerate(g.params):
            if not used_anywhere[i]:
                continue
            rows = out[p.slot.offset:p.slot.offset + p.local.numel()].view(p.local.shape)
            g.publish_grad(p, rows)
        g.storage.release()  # Note [the disk tier]: the gradients are written
        self.used = [False] * len(g.params)
        self._after_publishing(used_anywhere)
        # Note [tensor hooks on shards] in engine/groups/flat.py: last, for a hook may step an
        # optimizer on the shard and clear its gradient.
        for i, p in enumerate(g.params):
            hooks = p.shard._post_accumulate_grad_hooks if used_anywhere[i] else None
            for hook in list((hooks or {}).values()):
                hook(p.shard)

    def _before_publishing(self, used_anywhere: list[bool]) -> None:
        """A mode's check before the reduced rows are handed out (the default: none)."""

    def _after_publishing(self, used_anywhere: list[bool]) -> None:
        """A mode's note after the reduced rows were handed out (the default: none)."""

    @staticmethod
    def total_norm(comm: Comm, norms: torch.Tensor, grads: list[torch.Tensor],
                   norm_type: float) -> torch.Tensor:
        """The norm of every rank's gradients from this rank's: ``norms`` (one per
        non-empty local gradient in ``grads``), combined over ``comm`` (the shard group):
        a MAX for the infinity norm, else a sum of powers."""
        if math.isinf(norm_type):
            local = norms.max()
            comm.all_reduce(local, op=torch.distributed.ReduceOp.MAX,
                            what="clip_grad_norm_'s all-reduce")
            return local
        local = norms.pow(norm_type).sum()
        comm.all_reduce(local, what="clip_grad_norm_'s all-reduce")
        return local.pow(1.0 / norm_type)

    def note_rescaled(self) -> None:
        """``sw.clip_grad_norm_`` scaled the gradients handed out (the default: nothing
        to note)."""

    def rescaled_elsewhere(self) -> bool:
        """Whether the gradients handed out were rescaled by anything but
        ``sw.clip_grad_norm_`` (the default: never asked, so never)."""
        return False
