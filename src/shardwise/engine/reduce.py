"""Gradient reduction of one flat group: copy-in, reduce-scatter, gradient shards.

After a unit's backward, each full parameter's gradient is written, scaled by 1/N, into
a rank-major buffer (``engine/copies.py``) and reduce-scattered asynchronously (in a world of
one the buffer is the result); when backward ends, each rank's rows become the DTensor
parameters' ``.grad``. Inside ``no_sync`` the buffer keeps accumulating instead, and the
first synchronised backward reduces the sum. Under hybrid sharding (Note [hybrid
sharding] in comm/mesh.py) the reduced shard is then summed across the replicas holding the
same rows, also asynchronously: ``advance`` starts that sum as soon as the reduce-scatter
is done, so it overlaps the backward of the units that follow, as the reduce-scatter does.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Protocol, cast

import torch
from torch.distributed.tensor import DTensor

from ..comm.collectives import Comm
from ..errors import ShardwiseError
from ..exact.reduce import ExactExchange, exchange
from ..exact.sums import Binned, add_, encode
from .copies import rank_major, row_regions, write_rank_major
from .layout import ShardLayout


class Group(Protocol):
    """What a reduction needs of its :class:`~shardwise.engine.unit.FlatGroup` (which owns it;
    engine/unit.py imports this module, not the other way round)."""

    params: list[Any]  # the group's ShardedParams: .full, .shard, .local, .slot, .as_dtensor
    layout: ShardLayout
    gaps: Any
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    local: torch.Tensor
    comm: Comm
    replicate: Comm | None
    unit_name: str
    exact: bool  # Note [reproducible reduction]

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
    REDUCING = "reducing"            # _buf in flight to _out (_work, or _exact, pending)
    REPLICATING = "replicating"      # _out summed across replicas in place (_work pending)
    REDUCED = "reduced"              # _out: this rank's reduced rows, to publish


_ALLOWED = {
    Reduction.IDLE: {Reduction.ACCUMULATING, Reduction.REDUCING, Reduction.REPLICATING,
                     Reduction.REDUCED},
    Reduction.ACCUMULATING: {Reduction.ACCUMULATING, Reduction.REDUCING,
                             Reduction.REPLICATING, Reduction.REDUCED},
    Reduction.REDUCING: {Reduction.REPLICATING, Reduction.REDUCED, Reduction.IDLE},
    Reduction.REPLICATING: {Reduction.REDUCED, Reduction.IDLE},
    Reduction.REDUCED: {Reduction.IDLE},
}


class GradReduction:
    """The gradient side of a :class:`~shardwise.engine.unit.FlatGroup` (states: Reduction)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.used = [False] * len(group.params)  # had a local gradient since the last sync
        self.state = Reduction.IDLE
        self._buf: torch.Tensor | None = None   # ACCUMULATING, REDUCING
        self._out: torch.Tensor | None = None   # REDUCING, REDUCED
        self._work = None                       # REDUCING
        self._acc: Binned | None = None         # ACCUMULATING, exact mode
        self._exact: ExactExchange | None = None  # REDUCING, exact mode
        # Exact mode: each .grad this reduction published, and its version then.
        self._published: dict[int, tuple[weakref.ref, int]] = {}
        self._handed: float | None = None  # reproducible mode: rescaled_elsewhere

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
        if g.exact:
            self._start_exact(sync)
            return
        accumulating = self.state is Reduction.ACCUMULATING
        buf = self._buf if accumulating else None
        if buf is None:
            buf = rank_major(g.layout, g.gaps, g.reduce_dtype, g.local.device)
        with torch.no_grad():
            for i, p in enumerate(g.params):
                grad = p.full.grad
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
                self._move(Reduction.REDUCED)
            else:
                self._replicate()
            return
        self._move(Reduction.REDUCING)
        self._buf = buf
        self._out = torch.empty(g.layout.shard_numel, dtype=g.reduce_dtype,
                                device=g.local.device)
        self._work = g.comm.reduce_scatter(
            self._out, buf, async_op=True,
            what=f"the reduce-scatter of unit {g.unit_name!r}'s gradients")

    def _start_exact(self, sync: bool) -> None:
        """:meth:`start` in reproducible mode (Note [reproducible reduction]): this
        backward's gradients, unscaled, become one exact term of the accumulator."""
        g = self.group
        buf = torch.zeros(g.layout.gathered_numel, dtype=torch.float32, device=g.local.device)
        with torch.no_grad():
            for i, p in enumerate(g.params):
                grad = p.full.grad
                p.full.grad = None
                if grad is not None:
                    write_rank_major(buf, g.layout, g.layout.slots[i], grad.float())
                    self.used[i] = True
        term = encode(buf)
        del buf
        self._acc = term if self._acc is None else add_(self._acc, term)
        if not sync:
            self._move(Reduction.ACCUMULATING)
            return
        # The accumulator is let go only once the exchange started: if ranks diverged it
        # raises first, and what was accumulated stays, as under ACCUMULATING.
        self._exact = exchange(g.comm, self._acc, f"unit {g.unit_name!r}'s gradients")
        self._acc = None
        self._move(Reduction.REDUCING)

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

    def has_accumulated(self) -> bool:
        """Whether gradients accumulated under ``no_sync`` await their reduction."""
        return self.state is Reduction.ACCUMULATING

    def advance(self) -> None:
        """Wait for an in-flight reduce-scatter; under hybrid sharding, start the sum
        across replicas without waiting for it."""
        if self.state is Reduction.REDUCING and self._exact is not None:
            exact, self._exact = self._exact, None
            self._out = exact.result()
            self._move(Reduction.REDUCED)
            return
        if self.state is Reduction.REDUCING:
            assert self._work is not None
            self._work.wait()
            self._work = self._buf = None
            if self.group.replicate is None:
                self._move(Reduction.REDUCED)
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
            self._move(Reduction.REDUCED)

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
            if self._exact is not None:
                self._exact.discard()
            elif self._work is not None:
                self._work.discard()
            self._work = self._buf = self._exact = None
            self._move(Reduction.IDLE)
        elif self.state is Reduction.REDUCED:
            self._move(Reduction.IDLE)
        self._out = None

    def finish(self, used_anywhere: list[bool]) -> None:
        """Accumulate the reduced rows into each parameter's DTensor ``.grad``.

        A parameter no rank computed a gradient for keeps its ``.grad`` untouched, as under
        DistributedDataParallel with ``find_unused_parameters=True``.
        """
        self.wait()
        if self.state is not Reduction.REDUCED:
            return
        self._move(Reduction.IDLE)
        out, self._out = self._out, None
        assert out is not None
        g = self.group
        if g.exact:
            self._refuse_a_second_mean(used_anywhere)
        if out.dtype != g.dtype:
            out = out.to(g.dtype)
        for i, p in enumerate(g.params):
            if not used_anywhere[i]:
                continue
            rows = out[p.slot.offset:p.slot.offset + p.local.numel()].view(p.local.shape)
            if p.shard.grad is None:
                p.shard.grad = p.as_dtensor(rows)
            else:
                with torch.no_grad():
                    cast(DTensor, p.shard.grad).to_local().add_(rows)
            if g.exact:
                local = cast(DTensor, p.shard.grad)._local_tensor
                self._published[i] = (weakref.ref(local), local._version)
        self.used = [False] * len(g.params)
        if g.exact:
            self._handed = self._grad_fingerprint()

    def rescaled_elsewhere(self) -> bool:
        """Reproducible mode: whether the gradients handed out were changed since, by
        anything but ``sw.clip_grad_norm_`` (which notes its change): most likely
        ``torch.nn.utils.clip_grad_norm_``, whose norm depends on the world size. Told by
        their values: DTensor's in-place arithmetic bumps no version counter."""
        return self._handed is not None and self._grad_fingerprint() != self._handed

    def note_rescaled(self) -> None:
        """``sw.clip_grad_norm_`` scaled the gradients handed out, exactly: not a change
        :meth:`rescaled_elsewhere` reports."""
        if self._handed is not None:
            self._handed = self._grad_fingerprint()

    def _grad_fingerprint(self) -> float:
        """The sum of the absolute values of this rank's gradient rows, in float64: any
        scaling but by 1 changes it (one pass over the rows, in the reproducible mode
        only, once per step)."""
        total = 0.0
        for p in self.group.params:
            if p.shard.grad is not None:
                total += float(cast(DTensor, p.shard.grad)._local_tensor.double().abs().sum())
        return total

    def _refuse_a_second_mean(self, used_anywhere: list[bool]) -> None:
        """In the reproducible mode a synced backward hands out the mean over the step's
        micro-batches; adding a second one onto it (a synced backward per micro-batch,
        ``no_sync`` forgotten) would give a sum of partial means, scaled and rounded
        differently at every world size. Untouched since published: raise instead."""
        for i, p in enumerate(self.group.params):
            grad, seen = p.shard.grad, self._published.get(i)
            if not used_anywhere[i] or grad is None or seen is None:
                continue
            local = cast(DTensor, grad)._local_tensor
            if seen[0]() is local and local._version == seen[1]:
                raise ShardwiseError(
                    f"reproducible mode: a second synced backward reached {p.fqns[0]} "
                    f"before its gradient was used or cleared. Run all but the last "
                    f"micro-batch of a step under sw.no_sync(model) (sw.micro_batches "
                    f"splits the batch), and call optimizer.zero_grad() after each step")
