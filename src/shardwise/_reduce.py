"""Gradient reduction of one flat group: copy-in, reduce-scatter, gradient shards.

After a unit's backward, each full parameter's gradient is written, scaled by 1/N, into
a rank-major buffer (``_copies.py``) and reduce-scattered asynchronously (in a world of
one the buffer is the result); when backward ends, each rank's rows become the DTensor
parameters' ``.grad``. Inside ``no_sync`` the buffer keeps accumulating instead, and the
first synchronised backward reduces the sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.tensor import DTensor

from ._copies import rank_major, row_regions, write_rank_major

if TYPE_CHECKING:
    from ._unit import FlatGroup


class GradReduction:
    """The gradient side of a :class:`~shardwise._unit.FlatGroup`."""

    def __init__(self, group: FlatGroup) -> None:
        self.group = group
        self.used = [False] * len(group.params)  # had a local gradient since the last sync
        self._accum: torch.Tensor | None = None      # no_sync: summed full gradients
        self._in: torch.Tensor | None = None         # reduce-scatter input, while in flight
        self._out: torch.Tensor | None = None        # this rank's reduced rows
        self._work = None

    def start(self, sync: bool) -> None:
        """Move the full gradients into the reduction buffer; reduce-scatter if ``sync``.

        Outside ``no_sync`` the gradients are scaled by 1/N while copied, then summed, as
        DistributedDataParallel does, so results match it bit for bit at N=2.
        """
        g = self.group
        accumulating = self._accum is not None
        buf = self._accum
        if buf is None:
            buf = rank_major(g.layout, g.gaps, g.reduce_dtype, g.local.device)
        with torch.no_grad():
            for i, p in enumerate(g.params):
                grad = p.full.grad
                p.full.grad = None
                self._take(buf, i, grad, seen=self.used[i] and accumulating, sync=sync)
                self.used[i] |= grad is not None
        if not sync:
            self._accum = buf
            return
        self._accum = None
        if g.comm.world_size == 1:
            self._out = buf  # the sum over one rank, already in this rank's layout
            return
        self._in = buf
        self._out = torch.empty(g.layout.shard_numel, dtype=g.reduce_dtype,
                                device=g.local.device)
        self._work = g.comm.reduce_scatter(
            self._out, buf, async_op=True,
            what=f"the reduce-scatter of unit {g.unit_name!r}'s gradients")

    def _take(self, buf: torch.Tensor, i: int, grad: torch.Tensor | None, seen: bool,
              sync: bool) -> None:
        """Parameter ``i``'s part of :meth:`start`. ``seen``: ``buf`` already holds its
        gradients from earlier ``no_sync`` backward passes."""
        g = self.group
        slot = g.layout.slots[i]
        inv_n = 1.0 / g.comm.world_size
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
        return self._accum is not None

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._in = None

    def drop(self) -> None:
        """Forget an unfinished reduction (its backward was aborted)."""
        self.wait()
        self._out = None

    def finish(self, used_anywhere: list[bool]) -> None:
        """Accumulate the reduced rows into each parameter's DTensor ``.grad``.

        A parameter no rank computed a gradient for keeps its ``.grad`` untouched, as under
        DistributedDataParallel with ``find_unused_parameters=True``.
        """
        self.wait()
        out, self._out = self._out, None
        if out is None:
            return
        g = self.group
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
        self.used = [False] * len(g.params)
