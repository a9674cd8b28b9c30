"""The reproducible gradient reduction: exact sums of micro-batch gradients (issue 24).

Note [reproducible reduction]
With ``sw.shard(model, reproducible=True)`` a unit's gradients are not scaled, summed in
fp32 and averaged over ranks. Instead every backward's gradients (one micro-batch's, as
``sw.micro_batches`` hands them out) are one exact term of the unit's partial sum, under
``no_sync`` as outside it. The first backward outside ``no_sync`` reduces it: each rank
sends every other rank that rank's rows of its partial (an all-to-all) with a header of its
micro-batch count, and each rank sums its rows exactly and divides them by the number of
micro-batches summed over all ranks. Every element of the result is
``fp32(round64(S)) / M``: ``S`` the exact sum of that element's micro-batch gradients, ``M``
their number (Note [float64 partials] in exact/partial.py says how, and why it is exact).
That is a function of the set of micro-batch gradients alone: not of how they were spread
over ranks, nor of the order ranks add. So at any world size dividing the number of
micro-batches the gradient shards hold the same bits, element for element, and an
elementwise optimizer step keeps parameters and optimizer state identical too.

Costs: with one micro-batch per rank, nothing before the exchange, which sends the fp32
gradient (the default mode's bytes) and sums each rank's rows in one float64 pass; with
more, a float64 partial (8 bytes an element, against 4 for fp32 under ``no_sync``) added
to in one fused pass per micro-batch, and 8 bytes an element on the wire (BENCHMARKS.md,
"Exact sums", has the time each takes).

The binned sums of Note [exact sums] (exact/sums.py) serve ``exact_total`` and
``exact_average`` below: a gradient norm and averaged buffers, small and once a step.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.distributed as dist

from ..comm.collectives import Comm, unflatten_into
from .sums import (
    DEFAULT,
    INDEX_DTYPE,
    NONFINITE,
    align,
    encode,
    max_terms,
)

__all__ = ["exact_average", "exact_total"]


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
