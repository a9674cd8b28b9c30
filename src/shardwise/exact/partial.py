"""Exact sums of micro-batch gradients as float64 partials: the reproducible mode's numbers.

Note [float64 partials]
=======================
The reproducible mode (Note [reproducible reduction] in exact/reduce.py) needs each
element's sum over a step's micro-batch gradients to have the same bits however the
micro-batches are spread over ranks and in whatever order they are added. This module
gives, per element,

    fp32(round64(S)),   S the exact sum of the element's fp32 terms,

``round64`` rounding to the nearest float64 (ties to even), ``fp32`` to the nearest fp32 of
that; every NaN is the same NaN. S is a function of the multiset of terms, so the result is.

Every addition is a float64 one checked by TwoSum: for ``s = fl(a + b)``,
``e = (a - (s - (s - a))) + (b - (s - a))`` is exactly ``a + b - s`` (round to nearest, no
contraction or reassociation: inductor compiles without them, and a probe checks the
compiled passes against these eager ops bit for bit before first use, as in Note [fused
kernels]). A float64 holds 53 bits and an fp32 term 24, so the sums of a step's terms are
exact unless an element's terms lie more than about 2**29 apart; where one is not, the
exact value is still kept:

* A rank's micro-batches (``accumulate``, ``add_pieces``). The first gradient is kept as
  it is, fp32: with one micro-batch per rank, the common case, nothing else is done before
  the exchange. The second makes it a float64 partial ``P``, and each later one is added
  into ``P`` in place, straight from each parameter's ``.grad`` (no rank-major copy of the
  term), in one fused pass per piece that writes ``s`` into ``P`` and ``e`` into a scratch
  plane (12 bytes an element read, 16 written); the scratch's minimum and maximum (one
  more read) tell whether any ``e`` is not 0, and those, exact, go into a sparse list
  (element indices and values). So ``P`` plus the kept errors is exactly the sum of the
  rank's terms, always.
* The exchange (``Exchange``). Each rank sends every other rank that rank's rows of its
  ``P`` (fp32 while it holds one term: 4 bytes an element, the default mode's volume; else
  float64) in one all-to-all, and its header (terms, kept errors) in one all-gather issued
  beside it: no round trip before the data. The receiver adds the ranks' partials of its
  rows in rank order in float64, TwoSum-checked, in one pass. Where every addition was exact
  and no rank kept an error for the element, that sum is S itself, and its fp32 the result.
  Elsewhere (rare) every contribution, partials and kept errors (gathered from every rank
  only when some rank kept one), is summed by ``math.fsum``: round64(S), correctly rounded,
  hence the same float64 however the terms were grouped.
* Inf and NaN. An inf or NaN term makes ``P`` inf or NaN (no error is kept for it); which of
  NaN, +inf and -inf a float64 sum gives does not depend on the order of its terms, and
  NaN is made canonical. A zero sum is -0.0 exactly when every term is -0.0 (IEEE's rule,
  kept by any grouping); a parameter without a gradient in a micro-batch is a -0.0 term
  (the engine fills the first term's buffer with -0.0, and a later absent gradient adds
  nothing), so an absent gradient means the same whichever micro-batch it is.
* The wire under a backend's own all-to-all (NCCL) is always float64: it pairs messages
  by order, not size, and ranks whose counts differ must not exchange fp32 rows against
  float64 ones before the headers are compared. Under gloo each message's tag carries
  its size, so mismatched ones never pair: the fp32 wire is safe there.

Why not the binned sums of Note [exact sums] in exact/sums.py (this path's predecessor):
they are exact too, but the state is 10 to 17 bytes an element, the wire 16 plus the tops
agreed by an all-reduce before it, and encoding, aligning and decoding cost 4 to 9 ns an
element each (BENCHMARKS.md, "Exact sums"). Here the state is the gradient itself or a
float64, the wire 4 or 8 bytes, and each pass a float64 addition. The two define different
results (the binned sums keep 40 to 80 bits below an element's largest term; this keeps S
whole before rounding), so the gradients take this path at every world size; the binned
sums remain for ``exact_total`` and ``exact_average`` (norms, buffers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.collectives import EXCHANGES
from ..errors import ShardwiseError
from . import fused

__all__ = ["Exchange", "Partial", "accumulate", "exchange", "total"]

F64 = torch.float64


@dataclass
class Partial:
    """A rank's exact running sum of ``terms`` fp32 tensors (flat, rank-major): ``value``
    (fp32 while one term, then float64) plus the kept ``errors`` (Note [float64 partials])."""

    value: torch.Tensor
    terms: int = 1
    errors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.value.shape[0]

    def error_count(self) -> int:
        return sum(i.numel() for i, _ in self.errors)


def accumulate(acc: Partial | None, x: torch.Tensor) -> Partial:
    """``acc`` plus one more term ``x`` (a flat fp32 gradient), exactly. The first term is
    kept as given (not copied: the caller hands it over).

    Raises:
        ShardwiseError: ``x`` is not fp32 or not the accumulator's length.

    Example:
        >>> acc = None
        >>> for g in grads:
        ...     acc = accumulate(acc, g)
    """
    x = x.reshape(-1)
    if x.dtype != torch.float32:
        raise ShardwiseError(f"exact accumulate: gradients reach it as fp32 (the engine's "
                             f"rank-major buffer), got {x.dtype}; pass x.float()")
    if acc is None:
        return Partial(x)
    if x.numel() != acc.numel:
        raise ShardwiseError(f"exact accumulate: a term of {x.numel()} elements added to "
                             f"an accumulator of {acc.numel}")
    return add_pieces(acc, lambda t: [(t, x)])


Pieces = Callable[[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]


def add_pieces(acc: Partial, pieces: Pieces, spare: list[torch.Tensor] | None = None
               ) -> Partial:
    """``acc`` plus one more term given piece by piece, exactly: ``pieces(t)`` lists, for a
    tensor ``t`` laid out as ``acc.value``, pairs (a view of ``t``, the term's fp32 values
    there); elements in no piece add zero. The engine hands each parameter's gradient this
    way, straight from ``.grad`` into the partial's rank-major rows. ``spare`` lends the
    pass's scratch (``buffer``)."""
    value = acc.value if acc.value.dtype == F64 else acc.value.to(F64)
    scratch = buffer(value.numel(), F64, value.device, spare)
    errors = list(acc.errors)
    base = value.storage_offset()
    pairs = list(zip(pieces(value), pieces(scratch)))
    for (v, x), (e, _) in pairs:
        _run("add", _add_into, v)(v, x, e)
    # One look at the whole scratch (contiguous: faster than a look per piece); what lies
    # outside the pieces is stale, so a hit is confirmed piece by piece. NaN shows too.
    low, high = torch.aminmax(scratch)
    if bool(low != 0) or bool(high != 0):
        for (v, _), (e, _) in pairs:
            kept = (e != 0) & torch.isfinite(v)  # an inf or NaN sum keeps no error
            if bool(kept.any()):
                where = kept.nonzero()
                strides = torch.tensor(v.stride(), device=where.device)
                idx = (where * strides).sum(1) + int(v.storage_offset() - base)
                errors.append((idx, e[kept]))
        scratch.zero_()  # nothing stale for the next look
    if spare is not None:
        give_back(scratch, spare)
    return Partial(value, acc.terms + 1, errors)


# -- the passes, as plain torch ops (compiled by _run; these eager ops are their spec) ----


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = fl(a + b)`` in float64 and its exact error ``a + b - s`` (TwoSum)."""
    a, b = a.to(F64), b.to(F64)
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


def _add_into(p: torch.Tensor, x: torch.Tensor, err: torch.Tensor) -> None:
    """``p += x`` in float64, in place, and each addition's exact error into ``err``.
    (Arithmetic only: a mask or a reduction here, comparisons inductor vectorizes badly
    or a second loop, made this pass 3 to 7 times slower on CPU.)"""
    s, e = _two_sum(p, x)
    p.copy_(s)
    err.copy_(e)


def _chain(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-order float64 sum of ``parts`` and where an addition was inexact."""
    s = parts[0].to(F64)
    bad = torch.zeros_like(s, dtype=torch.bool)
    for part in parts[1:]:
        s, e = _two_sum(s, part)
        bad = bad | ((e != 0) & torch.isfinite(s))
    return s, bad


def _total(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 of the rank-order sum of ``parts`` (canonical NaN), and whether any addition
    was inexact."""
    s, bad = _chain(parts)
    out = s.to(torch.float32)
    out = torch.where(torch.isnan(out), float("nan"), out)
    return out, bad.any()


def total(parts: list[torch.Tensor], errors: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> torch.Tensor:
    """fp32(round64(S)) per element, S the exact sum of ``parts`` (each a partial of the
    same rows: fp32 or float64) and of the kept ``errors`` ((row indices, float64 values)
    pairs, any number per row). Note [float64 partials]."""
    name = "total of " + ", ".join(str(p.dtype).removeprefix("torch.") for p in parts)
    out, flag = _run(name, _total, parts[0], parts)(parts)
    if not bool(flag) and not errors:
        return out
    rows = [i for i, _ in errors]
    if bool(flag):  # which rows: recomputed eagerly, for this is rare
        rows.append(_chain(parts)[1].nonzero().squeeze(1))
    fix = torch.unique(torch.cat(rows))
    extra: dict[int, list[float]] = {}
    for idx, val in errors:
        for i, v in zip(idx.tolist(), val.tolist()):
            extra.setdefault(i, []).append(v)
    columns = torch.stack([p[fix].to(F64) for p in parts], dim=1).tolist()
    exact = []
    for i, values in zip(fix.tolist(), columns):
        values += extra.get(i, [])
        # A non-finite term: the kernel's answer (its class is order-independent).
        exact.append(math.fsum(values) if all(map(math.isfinite, values)) else math.nan)
    fixed = torch.tensor(exact, dtype=F64).to(torch.float32).to(out.device)
    keep = torch.isnan(fixed)
    out[fix] = torch.where(keep, out[fix], fixed)
    return out


# -- the exchange ---------------------------------------------------------------------------


@dataclass
class Exchange:
    """An issued exchange of partials (Note [float64 partials]); :meth:`result` gives this
    rank's rows of the mean over every rank's micro-batches."""

    comm: Any                 # comm.collectives.Comm
    what: str
    acc: Partial              # this rank's partial (its rows are read in place)
    headers: torch.Tensor     # [world, 2] int64: each rank's terms and kept errors
    received: list[torch.Tensor | None]  # rank r's rows of its partial (None: this rank)
    header_work: Any = None
    data_work: Any = None
    spare: list[torch.Tensor] | None = None

    def result(self) -> torch.Tensor:
        """This rank's rows of the mean over micro-batches, fp32.

        Raises:
            ShardwiseError: ranks accumulated different numbers of micro-batches.
        """
        world, rank = self.comm.world_size, self.comm.rank
        if self.header_work is not None:
            self.header_work.wait()
            self.header_work = None
        terms = self.headers[:, 0].tolist()
        if len(set(terms)) > 1:
            self._abandon()
            raise ShardwiseError(
                f"reproducible mode: ranks accumulated different numbers of micro-batches "
                f"({', '.join(f'rank {r}: {t}' for r, t in enumerate(terms))}) before "
                f"reducing {self.what}: every rank must run as many backward passes per "
                f"step (sw.micro_batches gives each rank the same number)")
        if self.data_work is not None:
            self.data_work.wait()
            self.data_work = None
        rows = self.acc.numel // world
        mine = self.acc.value[rank * rows:(rank + 1) * rows]
        parts = [mine if t is None else t for t in self.received]
        errors = self._errors(rows) if int(self.headers[:, 1].sum()) else []
        out = total(parts, errors).div_(sum(terms))
        if self.spare is not None:
            for t in self.received:
                if t is not None:
                    give_back(t, self.spare)
        self.received = []
        return out

    def _errors(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's kept errors of this rank's rows (a collective: every rank calls it,
        for every rank sees the same headers)."""
        mine = [(i.cpu(), e.cpu()) for i, e in self.acc.errors]
        everyone = ([mine] if self.comm.world_size == 1 else self.comm.all_gather_object(
            mine, what=f"the exchange of {self.what}'s kept errors"))
        lo, out = self.comm.rank * rows, []
        device = self.acc.value.device
        for theirs in everyone:
            for idx, val in theirs:
                here = (idx >= lo) & (idx < lo + rows)
                out.append(((idx[here] - lo).to(device), val[here].to(device)))
        return out

    def _abandon(self) -> None:
        """Ranks disagree: the data messages may never pair (their sizes differ); every
        rank leaves them to the backend at the same point (Note [checks ride the
        exchanges] in comm/channel.py)."""
        if self.data_work is not None:
            self.comm.channel.new_epoch()
            self.data_work.discard()
            self.data_work = None

    def discard(self) -> None:
        """Let the exchange finish without using it (its backward was aborted). The
        headers first: data whose counts differ may never arrive, and is left behind."""
        if self.header_work is not None:
            self.header_work.discard()
            self.header_work = None
            if len(set(self.headers[:, 0].tolist())) > 1:
                self._abandon()
        for attr in ("header_work", "data_work"):
            work = getattr(self, attr)
            if work is not None:
                work.discard()
                setattr(self, attr, None)


def exchange(comm: Any, acc: Partial, what: str) -> Exchange:
    """Start the reduction of ``acc`` (rank-major, every rank's rows) over ``comm``: the
    header all-gather and the all-to-all of partials, both in flight on return (Note
    [float64 partials]). ``comm.spare_buffers`` lends the receiving buffers."""
    world, rank, device = comm.world_size, comm.rank, acc.value.device
    if world > 1 and acc.value.dtype != F64 and comm.transport(acc.value) is not EXCHANGES:
        # A backend's own all-to-all (NCCL) pairs messages by order, not by size: ranks
        # whose counts differ would exchange fp32 rows against float64 ones before the
        # headers say so. One wire dtype whatever the count; gloo's exchanges tag each
        # message with its size, so mismatched ones never pair and the fp32 wire is safe.
        acc = Partial(acc.value.to(F64), acc.terms, acc.errors)
    # On the partial's device: a backend may not take host tensors (NCCL).
    header = torch.tensor([acc.terms, acc.error_count()], dtype=torch.int64, device=device)
    if world == 1:
        return Exchange(comm, what, acc, header.view(1, 2), [None])
    n = acc.numel
    rows = n // world
    headers = torch.empty(world, 2, dtype=torch.int64, device=device)
    header_work = comm.all_gather(headers.view(-1), header, async_op=True,
                                  what=f"the exchange of {what}'s micro-batch counts")
    spare = comm.spare_buffers
    sends = list(acc.value.view(world, rows).unbind(0))
    received: list[torch.Tensor | None] = [
        None if r == rank else buffer(rows, acc.value.dtype, acc.value.device, spare)
        for r in range(world)]
    outs = [t if t is not None else sends[rank] for t in received]
    data_work = comm.all_to_all(outs, sends, async_op=True,
                                what=f"the exchange of {what}")
    return Exchange(comm, what, acc, headers, received, header_work, data_work, spare)


def buffer(numel: int, dtype: torch.dtype, device: torch.device,
           spare: list[torch.Tensor] | None = None) -> torch.Tensor:
    """A receiving buffer or an add pass's scratch: one of that size and dtype from
    ``spare`` if there is one (on CPU a fresh tensor of tens of MiB is fresh pages from the
    kernel, which cost about as much again as writing them). A reused one holds what it
    held: a scratch's stale values cost ``add_pieces`` a false alarm at most."""
    for i, t in enumerate(spare or ()):
        if t.numel() == numel and t.dtype == dtype and t.device == device:
            assert spare is not None
            return spare.pop(i)
    # Zeros: ``add_pieces`` reads its scratch whole, where it wrote only pieces.
    return torch.zeros(numel, dtype=dtype, device=device)


def give_back(t: torch.Tensor, spare: list[torch.Tensor]) -> None:
    """``t`` (from :func:`buffer`) is read: keep it for the next exchange of its size, on
    CPU, the ``_SPARES`` most recent ones (at most that many buffers stay allocated between
    steps, and go with the model's communicator)."""
    if t.device.type != "cpu":  # the CUDA caching allocator reuses memory already
        return
    spare.append(t)
    del spare[:-_SPARES]


_SPARES = 4


# -- compiled passes (Note [fused kernels]) ---------------------------------------------------


def _run(name: str, fn: Callable[..., Any], like: torch.Tensor,
         parts: list[torch.Tensor] | None = None) -> Callable[..., Any]:
    """``fn`` compiled and checked on the probe, or ``fn`` itself (eager, the same bits).
    The probe runs on ``like``'s device; for ``_total``, with as many ``parts`` of their
    dtypes (one compiled kernel per name, so the name says both)."""
    if like.numel() < fused.FUSE_MIN or not fused.enabled():
        return fn
    kinds = [(p.dtype, p.device) for p in parts] if parts is not None else None
    return fused.kernel(f"partial {name} on {like.device.type}", fn,
                        lambda c: _matches(fn, c, like.device, kinds)) or fn


def _probe_terms(device: torch.device) -> list[torch.Tensor]:
    """Three terms of every kind: fused.probe()'s values (every exponent, ties, inf, NaN,
    random bits), and two shuffles of them, one scaled by 2**-35, so that many additions
    are inexact and many exact."""
    x = fused.probe().to(device)
    return [x, x.roll(1), x.roll(7) * 2.0**-35]


def _matches(fn: Callable[..., Any], compiled: Callable[..., Any], device: torch.device,
             kinds: list[tuple[torch.dtype, torch.device]] | None) -> bool:
    """Whether a compiled pass gives the eager pass's bits on the probe: ``_total`` with
    parts of ``kinds`` (partials where float64), ``_add_into`` on a contiguous tensor and
    on 2-D strided pieces as the engine hands them (Note [float64 partials])."""
    a, b, c = _probe_terms(device)
    if fn is _total:
        assert kinds is not None
        terms = [(a, b, c)[i % 3] * 2.0 ** -(i // 3) for i in range(len(kinds))]
        parts = [t.to(F64) + t.roll(3) if dtype == F64 else t.to(dtype)
                 for t, (dtype, _) in zip(terms, kinds)]
        return _same(fn(parts), compiled(parts))
    n = a.numel() - a.numel() % 6
    for shape, cols in (((n,), None), ((3, n // 3), slice(5, n // 3 - 7))):
        want_out, got_out = ((a.to(F64) + b)[:n].view(shape) for _ in range(2))
        want_err, got_err = (torch.full(shape, 7.0, dtype=F64, device=device)
                             for _ in range(2))
        x = c[:n].view(shape)
        if cols is not None:  # a parameter's rows in a rank-major buffer: strided
            want_out, got_out, want_err, got_err, x = (
                t[:, cols] for t in (want_out, got_out, want_err, got_err, x))
        fn(want_out, x, want_err)
        compiled(got_out, x, got_err)
        if not (_same(want_out, got_out) and _same(want_err, got_err)):
            return False
    return True


def _same(want: Any, got: Any) -> bool:
    """Bit for bit, through tuples, except that any NaN equals any NaN: a partial's NaN
    payload depends on which operand the hardware propagates and never reaches a result
    (``_total`` makes every NaN canonical after the sum)."""
    if isinstance(want, tuple):
        return len(want) == len(got) and all(_same(w, g) for w, g in zip(want, got))
    if want.dtype != got.dtype or want.shape != got.shape:
        return False
    if want.is_floating_point():
        bits = {torch.float64: torch.int64, torch.float32: torch.int32}[want.dtype]
        nan = torch.isnan(want)
        return (torch.equal(nan, torch.isnan(got))
                and torch.equal(want.view(bits)[~nan], got.view(bits)[~nan]))
    return torch.equal(want, got)

