"""The reproducible gradient reduction: exact sums of micro-batch gradients (issue 24).

Note [reproducible reduction]
With ``sw.shard(model, reproducible=True)`` a unit's gradients are not scaled, summed in
fp32 and averaged over ranks. Instead every backward's gradients (one micro-batch's, as
``sw.micro_batches`` hands them out) are encoded as one exact term in fixed bins (Note
[exact sums] in exact/sums.py) and added to the unit's binned accumulator, exactly, under
``no_sync`` as outside it. The first backward outside ``no_sync`` reduces the
accumulator: one all-reduce of each element's top bin (MAX) and of the micro-batch count,
then the bins, aligned to those tops, are reduce-scattered as int64 (integer sums are
exact in any order), and each rank decodes its rows once and divides them by the number
of micro-batches summed over all ranks. The kept part of every term, hence every bit of
the result, is a function of the set of micro-batch gradients alone: not of how they
were spread over ranks, nor of the order ranks add. So at any world size dividing the
number of micro-batches the gradient shards hold the same bits, element for element,
and an elementwise optimizer step keeps parameters and optimizer state identical too.

Costs: the accumulator holds 10 bytes per parameter element (Note [narrow accumulator] in
exact/narrow.py: top bin, float64 value, int8 carry; 17 in the wide form it falls back to)
from the first micro-batch to the reduction, against 4 for fp32 under ``no_sync``; the
reduction sends 1 byte of top bin and 16 of bins per element instead of 4, laid out from
whatever the rank holds in one pass after the all-reduce of tops (Note [aligned wire] in
exact/wire.py: a lone micro-batch's gradient is encoded only then); encoding, adding and
decoding run as fused kernels (Note [fused kernels] in exact/fused.py; their
time per element is in BENCHMARKS.md, "Exact sums").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from ..comm.collectives import Comm, unflatten_into
from ..errors import ShardwiseError
from . import wire
from .narrow import Narrow, Term
from .sums import (
    DEFAULT,
    INDEX_DTYPE,
    NONFINITE,
    Binned,
    align,
    check_terms,
    encode,
    max_terms,
)


@dataclass
class ExactExchange:
    """An issued reduction of a binned accumulator; :meth:`result` gives the rows."""

    work: object | None      # the reduce-scatter in flight (None in a world of one)
    index: torch.Tensor      # this rank's elements' top bins
    bins: torch.Tensor       # this rank's summed bins, [2, rows] (Note [aligned wire])
    terms: int               # micro-batches summed over every rank
    sending: torch.Tensor | None = None  # read by the exchange until it is waited for
    spare: list[torch.Tensor] | None = None  # where its buffers go once read (Comm's)

    def result(self) -> torch.Tensor:
        """This rank's rows of the mean over micro-batches, fp32."""
        if self.work is not None:
            self.work.wait()  # type: ignore[attr-defined]
            self.work = None
        if self.sending is not None and self.spare is not None:
            wire.give_back(self.sending, self.spare)  # sent: for the next exchange
        self.sending = None
        check_terms(self.terms)
        total = wire.decode(self.index, self.bins, self.terms).div_(self.terms)
        if self.spare is not None:
            wire.give_back(self.bins, self.spare)  # decoded into a new tensor: reusable
        return total

    def discard(self) -> None:
        """Let the reduction finish without decoding it (its backward was aborted)."""
        if self.work is not None:
            self.work.discard()  # type: ignore[attr-defined]
            self.work = self.sending = None


def exchange(comm: Comm, acc: Binned | Narrow | Term, what: str) -> ExactExchange:
    """Start the reduction of ``acc`` (rank-major, every rank's rows) over ``comm``. The
    wire carries the wide form aligned to every rank's tops, whichever form each rank
    accumulated in, laid out from it in one pass (Note [aligned wire] in exact/wire.py).

    Raises:
        ShardwiseError: ranks accumulated different numbers of micro-batches.
    """
    n, world = acc.numel, comm.world_size
    check_terms(acc.terms)
    mine = wire.tops(acc)
    if world == 1:
        return ExactExchange(None, mine, wire.lay_out(acc, mine, 1, comm.spare_buffers)
                             .view(2, n), acc.terms, spare=comm.spare_buffers)
    # The tops travel as int8, one byte an element, and the count with them as base-128
    # digits, each with its negation: equal on every rank exactly when the maximum of d
    # and of -d give back d for every digit (same_everywhere's rule, digit by digit).
    digits = torch.tensor([(acc.terms >> (7 * i)) & 127 for i in range(_COUNT_DIGITS)],
                          dtype=INDEX_DTYPE, device=mine.device)
    seen = torch.cat([mine, digits, -digits])
    comm.all_reduce(seen, op=dist.ReduceOp.MAX, what=f"the exchange of top bins of {what}")
    high = seen[n:n + _COUNT_DIGITS].to(torch.int64)
    low = -seen[n + _COUNT_DIGITS:].to(torch.int64)
    if not torch.equal(high, low):
        raise ShardwiseError(
            f"reproducible mode: ranks accumulated different numbers of micro-batches "
            f"({acc.terms} on rank {comm.rank}) before reducing "
            f"{what}: every rank must run as many backward passes per step "
            f"(sw.micro_batches gives each rank the same number)")
    index = seen[:n]
    sending = wire.lay_out(acc, index, world, comm.spare_buffers)
    rows = n // world
    out = wire.buffer((2, rows), sending.device, comm.spare_buffers)
    work = comm.reduce_scatter(out.view(-1), sending.view(-1), async_op=True,
                               what=f"the reduce-scatter of {what}'s bins")
    index = index[comm.rank * rows:(comm.rank + 1) * rows].clone()
    return ExactExchange(work, index, out, acc.terms * world, sending, comm.spare_buffers)


_COUNT_DIGITS = 4  # base-128 digits of a micro-batch count: up to 2**28, above max_terms


def exact_total(comm: Comm, tensors: list[torch.Tensor]) -> float:
    """The sum of every element of every rank's ``tensors``, exact up to the bits kept
    (Note [exact sums]: 40 below the top bin of the largest element), so the same float
    however the elements are spread over ranks; rounded once, to float64. For
    ``clip_grad_norm_`` and the like in the reproducible mode (a collective).
    """
    spec = DEFAULT
    flat = (torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors
            else torch.zeros(0))
    b = encode(flat, spec)
    top = torch.tensor([int(b.index.max()) if flat.numel() else 0], dtype=torch.int32)
    if comm.world_size > 1:
        comm.all_reduce(top, op=dist.ReduceOp.MAX, what="the exchange of an exact sum's top")
    t = int(top[0])
    aligned = align(b, torch.full_like(b.index, t))
    sums = [0] * spec.K
    step = max_terms(spec)  # elements per chunk: no int64 accumulator can overflow
    for start in range(0, flat.numel(), step):
        part = aligned.bins[start:start + step].sum(dim=0)
        sums = [s + int(v) for s, v in zip(sums, part.tolist())]
    everyone = [sums] if comm.world_size == 1 else comm.all_gather_object(
        sums, what="the exchange of an exact sum's bins")
    totals = [sum(r[k] for r in everyone) for k in range(spec.K)]
    if t == NONFINITE:  # slot 0 counts +inf terms, slot 1 -inf (NaN counts as both)
        if totals[0] and totals[1]:
            return math.nan
        return math.inf if totals[0] else -math.inf
    value = sum(Fraction(s) * Fraction(2) ** (spec.base + (t - k) * spec.W)
                for k, s in enumerate(totals))
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def exact_average(comm: Comm, tensors: list[torch.Tensor], what: str) -> None:
    """Replace floating ``tensors`` in place by their mean over ranks, each element the
    exact sum of the ranks' values (bits kept as in Note [exact sums]) divided by the
    number of ranks and rounded once: a function of the set of values, not of their
    order. For ``buffers="average"`` in the reproducible mode; elementwise in Python,
    so meant for buffers (BatchNorm statistics), not for parameters.
    """
    tensors = [t for t in tensors if t.is_floating_point()]
    if not tensors or comm.world_size == 1:
        return
    spec = DEFAULT
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    b = encode(flat, spec)
    index = b.index.to(torch.int32)
    comm.all_reduce(index, op=dist.ReduceOp.MAX, what=f"the exchange of top bins of {what}")
    bins = align(b, index.to(INDEX_DTYPE)).bins.clone()
    comm.all_reduce(bins, what=f"the exact sum of {what}")
    unit = Fraction(2) ** spec.W
    out = []
    for top, row in zip(index.tolist(), bins.tolist()):
        if top == NONFINITE:
            out.append(math.nan if row[0] and row[1] else math.inf if row[0] else -math.inf)
            continue
        exact = sum(Fraction(v) / unit ** k for k, v in enumerate(row))
        out.append(float(exact * Fraction(2) ** (spec.base + top * spec.W) / comm.world_size))
    unflatten_into(torch.tensor(out, dtype=torch.float64), tensors, same_bits=False)
