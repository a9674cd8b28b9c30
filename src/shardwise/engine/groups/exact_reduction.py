"""The reproducible mode's gradient reduction: the one place the engine sums exactly.

A :class:`~shardwise.engine.groups.reduce.GradReduction` whose copy-in encodes each backward's
gradients, unscaled, as exact terms, and whose reduction is an exact exchange of their
sum (Note [reproducible reduction] in exact/reduce.py); the states and their moves are
the base class's. It also refuses a second synced mean in one step and tells whether
the gradients it handed out were rescaled by anything but ``sw.clip_grad_norm_``.
``flat_group`` (engine/groups/flat.py) gives a group this class instead of the default when
``shard(reproducible=True)``.
"""

from __future__ import annotations

import math
import weakref
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from ...comm.collectives import Comm
from ...errors import ShardwiseError
from ...exact.partial import Exchange, Partial, add_pieces, exchange
from ...exact.reduce import exact_total
from .copies import row_regions, write_rank_major
from .reduce import GradReduction, Group, Reduction
from .tensor_parallel import local_grad


class ExactReduction(GradReduction):
    """The gradient side of a reproducible-mode ``FlatGroup``."""

    exact = True
    reduces_every_backward = True

    def holds_partial_step(self) -> bool:
        """A step's micro-batches half summed: their exact sum is in no checkpoint."""
        return self.has_accumulated()

    def cast_refusal(self) -> str | None:
        return ("the model is reproducible (sw.shard(reproducible=True)), whose exact sums "
                "are of float32")

    def __init__(self, group: Group) -> None:
        super().__init__(group)
        self._acc: Partial | None = None  # ACCUMULATING: the exact sum so far
        self._exchange: Exchange | None = None  # REDUCING
        # Each .grad handed out, and its version then (_before_publishing).
        self._published: dict[int, tuple[weakref.ref, int]] = {}
        self._handed: float | None = None  # rescaled_elsewhere
        self.summed = 0  # micro-batches in the last exchange (Note [a divided loss])

    def start(self, sync: bool) -> None:
        """This backward's gradients, unscaled, become one exact term of the accumulator;
        if ``sync``, the accumulator is exchanged (Note [reproducible reduction])."""
        g = self.group
        grads: list[tuple[int, torch.Tensor]] = []
        for i, p in enumerate(g.params):
            grad = p.full.grad
            if isinstance(grad, DTensor):  # Note [tensor-parallel parameters]
                grad = local_grad(grad, p.full)
            p.full.grad = None
            if grad is not None:
                grads.append((i, grad.detach().float()))
                self.used[i] = True

        def pieces(t: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
            """Each gradient's rows in ``t`` (laid out rank-major) and its values there."""
            out = []
            for i, grad in grads:
                flat = grad.reshape(-1)
                for region, sl in row_regions(t, g.layout, g.layout.slots[i]):
                    out.append((region, flat[sl].view(region.shape)))
            return out

        with torch.no_grad():
            # Note [float64 partials]: the first term as a rank-major fp32 buffer, each
            # later one added from .grad into the partial's rows.
            if self._acc is None:
                # -0.0, the additive identity, where a parameter has no gradient: what a
                # later micro-batch's absent gradient adds (nothing), so a zero's sign does
                # not depend on which micro-batch came first (Note [float64 partials]).
                buf = torch.full((g.layout.gathered_numel,), -0.0, dtype=torch.float32,
                                 device=g.device)
                for i, grad in grads:
                    write_rank_major(buf, g.layout, g.layout.slots[i], grad)
                self._acc = Partial(buf)
            else:
                self._acc = add_pieces(self._acc, pieces, g.comm.spare_buffers)
        if not sync:
            self._move(Reduction.ACCUMULATING)
            return
        # The exchange holds the accumulator until its result is read (its own rows are
        # summed in place); ranks that accumulated different counts are named there.
        self.summed = self._acc.terms
        self._exchange = exchange(g.comm, self._acc, f"unit {g.unit_name!r}'s gradients")
        self._acc = None
        self._move(Reduction.REDUCING)


    def clear_refusal(self, which: list[int]) -> str | None:
        """Why ``zero_grad`` may not clear only the parameters at ``which`` now: the
        exact sum of the micro-batches accumulated so far is one value per group (its
        count of micro-batches included), dropped whole or not at all."""
        g = self.group
        if self.state is not Reduction.ACCUMULATING or set(which) >= set(range(len(g.params))):
            return None
        names = [g.params[i].fqns[0] for i in which]
        return (f"reproducible mode: zero_grad reached {len(names)} of the {len(g.params)} "
                f"parameters of unit {g.unit_name!r} ({', '.join(names[:3])}) while its "
                f"micro-batch gradients accumulate under sw.no_sync: their exact sum is "
                f"kept for the unit's parameters together. Clear every parameter "
                f"(model.zero_grad(), or an optimizer over all of them), or clear after "
                f"the step")

    def clear(self, which: list[int]) -> None:
        """``zero_grad`` reached every parameter of the group (:meth:`clear_refusal`
        refused anything less): the exact sum so far is dropped."""
        if self.state is not Reduction.ACCUMULATING:
            return
        self._acc = None
        self.used = [False] * len(self.group.params)
        self._move(Reduction.IDLE)

    def advance(self) -> None:
        """The exchange's result, once there: this rank's rows of the exact mean."""
        if self.state is Reduction.REDUCING and self._exchange is not None:
            exchanged, self._exchange = self._exchange, None
            self._out = exchanged.result()
            self._reduced()
            return
        super().advance()

    def drop(self) -> None:
        if self._exchange is not None:
            self._exchange.discard()
            self._exchange = None
        super().drop()

    def _before_publishing(self, used_anywhere: list[bool]) -> None:
        self._refuse_a_second_mean(used_anywhere)

    def _after_publishing(self, used_anywhere: list[bool]) -> None:
        for i, p in enumerate(self.group.params):
            if used_anywhere[i] and p.shard.grad is not None:
                local = cast(DTensor, p.shard.grad)._local_tensor
                self._published[i] = (weakref.ref(local), local._version)
        self._handed = self._grad_fingerprint()

    def rescaled_elsewhere(self) -> bool:
        """Reproducible mode: whether the gradients handed out were changed since, by
        anything but ``sw.clip_grad_norm_`` (which notes its change): most likely
        ``torch.nn.utils.clip_grad_norm_``, whose norm depends on the world size. Told by
        their values: DTensor's in-place arithmetic bumps no version counter."""
        return self._handed is not None and self._grad_fingerprint() != self._handed

    @staticmethod
    def total_norm(comm: Comm, norms: torch.Tensor, grads: list[torch.Tensor],
                   norm_type: float) -> torch.Tensor:
        """Reproducible mode: the sum of |g|^p over every element, exact (Note [exact
        sums]), so the norm does not depend on how rows are split over ranks. The
        infinity norm's MAX needs nothing more."""
        if math.isinf(norm_type):
            return GradReduction.total_norm(comm, norms, grads, norm_type)
        powered = [g.float().abs().pow(norm_type) for g in grads]
        value = exact_total(comm, powered) ** (1.0 / norm_type)
        return torch.tensor(value, dtype=torch.float32, device=norms.device)

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
