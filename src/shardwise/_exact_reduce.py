"""The reproducible gradient reduction: exact sums of micro-batch gradients (issue 24).

Note [reproducible reduction]
With ``sw.shard(model, reproducible=True)`` a unit's gradients are not scaled, summed in
fp32 and averaged over ranks. Instead every backward's gradients (one micro-batch's, as
``sw.micro_batches`` hands them out) are encoded as one exact term in fixed bins (Note
[exact sums] in _exact_sum.py) and added to the unit's binned accumulator, exactly, under
``no_sync`` as outside it. The first backward outside ``no_sync`` reduces the
accumulator: one all-reduce of each element's top bin (MAX) and of the micro-batch count,
then the bins, aligned to those tops, are reduce-scattered as int64 (integer sums are
exact in any order), and each rank decodes its rows once and divides them by the number
of micro-batches summed over all ranks. The kept part of every term, hence every bit of
the result, is a function of the set of micro-batch gradients alone: not of how they
were spread over ranks, nor of the order ranks add. So at any world size dividing the
number of micro-batches the gradient shards hold the same bits, element for element,
and an elementwise optimizer step keeps parameters and optimizer state identical too.

Costs: the accumulator holds 17 bytes per parameter element (index + two int64 bins)
from the first micro-batch to the reduction, against 4 for fp32 under ``no_sync``; the
reduction sends 4 bytes of top bin and 16 of bins per element instead of 4; encoding and
decoding take tens of milliseconds per million elements on a CPU (BENCHMARKS.md, "Exact
sums").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._comm import Comm
from ._exact_sum import INDEX_DTYPE, Binned, align, check_terms, decode
from .errors import ShardwiseError


@dataclass
class ExactExchange:
    """An issued reduction of a binned accumulator; :meth:`result` gives the rows."""

    work: object | None      # the reduce-scatter in flight (None in a world of one)
    index: torch.Tensor      # this rank's elements' top bins
    bins: torch.Tensor       # this rank's summed bins, [rows, K]
    terms: int               # micro-batches summed over every rank
    sending: torch.Tensor | None = None  # read by the exchange until it is waited for

    def result(self) -> torch.Tensor:
        """This rank's rows of the mean over micro-batches, fp32."""
        if self.work is not None:
            self.work.wait()  # type: ignore[attr-defined]
            self.work = self.sending = None
        check_terms(self.terms)
        total = decode(Binned(self.index, self.bins, self.terms))
        return total.div_(self.terms)


def exchange(comm: Comm, acc: Binned, what: str) -> ExactExchange:
    """Start the reduction of ``acc`` (rank-major, every rank's rows) over ``comm``.

    Raises:
        ShardwiseError: ranks accumulated different numbers of micro-batches.
    """
    n, world = acc.numel, comm.world_size
    if world == 1:
        return ExactExchange(None, acc.index, acc.bins, acc.terms)
    # The count travels with the tops, with its negation: equal on every rank exactly
    # when the maximum of c and of -c give back c (same_everywhere's rule).
    seen = torch.cat([acc.index.to(torch.int32),
                      torch.tensor([acc.terms, -acc.terms], dtype=torch.int32,
                                   device=acc.index.device)])
    comm.all_reduce(seen, op=dist.ReduceOp.MAX, what=f"the exchange of top bins of {what}")
    most, least = int(seen[-2]), -int(seen[-1])
    if most != least:
        raise ShardwiseError(
            f"reproducible mode: ranks accumulated between {least} and {most} micro-batches "
            f"before reducing {what}: every rank must run as many backward passes per step "
            f"(sw.micro_batches gives each rank the same number)")
    index = seen[:n].to(INDEX_DTYPE)
    aligned = align(acc, index)
    rows = n // world
    mine = slice(comm.rank * rows, (comm.rank + 1) * rows)
    out = torch.empty(rows, acc.spec.K, dtype=torch.int64, device=acc.bins.device)
    sending = aligned.bins.reshape(-1)
    work = comm.reduce_scatter(out.view(-1), sending, async_op=True,
                               what=f"the reduce-scatter of {what}'s bins")
    return ExactExchange(work, index[mine].clone(), out, acc.terms * world, sending)
