"""The exchange's wire form: a rank's exact sum aligned to every rank's tops, in one pass.

Note [aligned wire]
===================
The exchange (Note [reproducible reduction] in exact/reduce.py) sends each element's wide
state (Note [exact sums]) aligned to the MAX of the ranks' top bins. It used to build that
in three passes over the unit, each writing a fresh 16-byte-an-element tensor: encode (or
widen a narrow accumulator) at the rank's own tops, align to the MAX, and the reduce-scatter
read the result; then decode read 16 bytes a row, interleaved. On CPU a fresh tensor of
over 32 MiB is new pages from the kernel (glibc maps it), so every such tensor costs about
as much again as writing it. This module goes from what the rank holds straight to the
aligned wire form:

* ``Term``: the synced backward's term when nothing was accumulated before it (one
  micro-batch per rank, the common case) is kept as the fp32 gradient itself. ``tops``
  gives its top bins for the all-reduce (1 byte an element written), and ``encode_at``
  computes the aligned bins from the fp32 value and the MAX ``T``: encoding's two digits at
  the element's own top ``t`` (``fused.digits2``, integer shifts of the significand),
  kept if ``t = T``, the top one moved one slot down if ``t = T - 1``, none below: that
  is ``align(encode(x), T)`` digit for digit, in one loop.
* a ``Narrow`` accumulator (Note [narrow accumulator]): ``widen_at`` is ``widen`` followed
  by ``align``, fused (the last micro-batch's pass now ends in the narrow state).
* a wide ``Binned`` (a rank that fell back): aligned as before, then laid out the same way.

Layout: ``[world, 2, rows]`` int64, so rank ``r``'s part of the reduce-scatter,
``[2, rows]``, is contiguous, and each slot a contiguous plane: the decode reads two planes
instead of an interleaved ``[rows, 2]`` (inductor vectorizes planes; half the decode's
time). The bits on the wire and after the decode are those of the wide path, element for
element (tests/test_exact_sum.py compares them at world sizes 1 to 3, and
tests/test_reproducible.py a training run's); only the order of the int64 words differs.

Buffers: the passes write into a buffer from ``buffer`` (``out`` argument: inductor writes
it in place, and ``_INLINE`` keeps it from putting the digits in temporaries first), and
the exchange gives the wire and the receiving buffer back once they are read; on CPU the
four given back last are kept, in a list the model's communicator holds
(``Comm.spare_buffers``), for the next exchange of their size (the next unit's, or the
next step's for a unit of its own size). That memory (at most four buffers of 16 bytes
an element of a unit) stays allocated between steps, the price of not paying new pages
each step, and goes with the model. On a GPU nothing is kept (the caching allocator
reuses memory already).

Like Note [fused kernels], each pass runs compiled and is checked bit for bit on
``fused.probe()`` against the wide eager code (``encode``, ``align``, ``decode`` in
sums.py) before first use; without a compiler it runs eagerly, the same bits.
``SHARDWISE_NARROW=0`` accumulates in the wide form (sums.py's ``add``), which this
module then lays out and decodes as any other form: it is not a way around these passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ShardwiseError
from . import fused
from .narrow import Narrow, Term, widen
from .sums import (
    _F32_OVERFLOW,
    DEFAULT,
    INDEX_DTYPE,
    NONFINITE,
    Binned,
    _align_eager,
    _decode_eager,
    _encode_eager,
    align,
    encode,
)

__all__ = ["buffer", "decode", "give_back", "lay_out", "tops", "wide"]

_W, _BASE = DEFAULT.W, DEFAULT.base
# floor(v / W) for v in [0, 254] as (v * _MUL) >> 16: a multiply and a shift vectorize, an
# integer division does not (5 ns an element against 0.4). Checked over the whole range here.
_MUL = 1639
assert all((v * _MUL) >> 16 == v // _W for v in range(255)), "retune _MUL for this W"


# -- the passes, as plain torch ops (compiled by _run; the wide eager code is their spec) ----


def _tops(x: torch.Tensor) -> torch.Tensor:
    """Each fp32 element's top bin, ``encode``'s index."""
    bits = x.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    v = biased.clamp(min=1) - 1  # lead + 126, lead = floor(log2|x|) (-126 for subnormals)
    top = ((v * _MUL) >> 16) + 1
    top = torch.where((bits & 0x7FFFFFFF) != 0, top, 0)
    return torch.where(biased == 0xFF, NONFINITE, top).to(INDEX_DTYPE)


def _encode_at(x: torch.Tensor, to: torch.Tensor, world: int, out: torch.Tensor) -> None:
    """``align(encode(x), to)``'s bins into ``out`` (``[world, 2, rows]``); ``to`` at or
    above ``x``'s own tops (``lay_out`` checks)."""
    # encode's digits at x's own top (in integers: float64 conversions do not vectorize),
    # moved down as align moves them: the top digit one slot per bin of difference.
    top, b0, b1 = fused.digits2(x.view(world, -1), _W)
    d = to.view(world, -1).to(torch.int64) - top.to(torch.int64)
    _write_slots(out, d, b0, b1)


def _write_slots(out: torch.Tensor, d: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor) -> None:
    """``out[:, k]`` = slot k of the bins ``(b0, b1)`` moved down by ``d`` bins: one loop
    over the elements storing both slots (with ``_INLINE``, no temporary tensor)."""
    out[:, 0].copy_(torch.where(d == 0, b0, 0))
    out[:, 1].copy_(torch.where(d == 0, b1, torch.where(d == 1, b0, 0)))


def _widen_at(index: torch.Tensor, value: torch.Tensor, carry: torch.Tensor, to: torch.Tensor,
              world: int, out: torch.Tensor) -> None:
    """``align(widen(narrow), to)``'s bins into ``out`` (``[world, 2, rows]``); ``to`` at
    or above the narrow state's tops (``lay_out`` checks)."""
    index, value, carry, to = (v.view(world, -1) for v in (index, value, carry, to))
    a = torch.round(value) + carry.to(torch.float64)
    b = (value - a) * float(2**_W)
    d = to.to(torch.int64) - index.to(torch.int64)
    _write_slots(out, d, a.to(torch.int64), b.to(torch.int64))


def _decode_planes(index: torch.Tensor, planes: torch.Tensor,
                   overflow: float) -> tuple[torch.Tensor, ...]:
    """``fused.decode2`` on ``[2, rows]`` planes: the fp32 sums, and the flags (a top sum
    beyond 53 bits, non-finite elements, fp32 overflow) as one int8."""
    bad = index == NONFINITE
    top = torch.where(bad, 0, index.to(torch.int64))
    bottom = _BASE + (top - 1) * _W
    b0, b1 = planes[0], planes[1]
    c = b1 >> _W
    lo_i = b1 - (c << _W)
    hi_i = b0 + c
    big = hi_i.abs() >= 2**53
    unit = fused.pow2(bottom)
    hi = hi_i.to(torch.float64) * (unit * float(2**_W))
    lo = lo_i.to(torch.float64) * unit
    s = hi + lo
    back = s - hi
    err = (hi - (s - back)) + (lo - back)
    bits = s.view(torch.int64)  # round to odd as in fused.decode2
    outward = torch.where((err > 0) == (s > 0), 1, -1)
    ro = (bits + torch.where((err != 0) & ((bits & 1) == 0), outward, 0)).view(torch.float64)
    over = ro.abs() >= overflow
    out = ro.to(torch.float32)
    out = torch.where(over, torch.copysign(torch.full_like(out, float("inf")), out), out)
    pos = b0 > 0
    negc = b1 > 0
    special = torch.where(pos == negc, torch.full_like(out, float("nan")),
                          torch.where(pos, float("inf"), float("-inf")).to(out.dtype))
    out = torch.where(bad, special, out)
    flags = (big.to(torch.int8) | (bad.to(torch.int8) << 1)
             | ((over & ~bad).to(torch.int8) << 2)).amax()
    return out, flags


# -- public operations -----------------------------------------------------------------------


def tops(acc: Term | Narrow | Binned) -> torch.Tensor:
    """What a rank sends to the all-reduce MAX: its top bin per element (int8)."""
    if isinstance(acc, Term):
        return _run("tops", _tops, acc.numel)(acc.x)
    return acc.index


def lay_out(acc: Term | Narrow | Binned, to: torch.Tensor, world: int,
            spare: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``acc``'s wide state aligned to the tops ``to`` (each >= ``tops(acc)``), as int64
    ``[world, 2, rows]`` (Note [aligned wire]), in a buffer from :func:`buffer` (taken
    from ``spare`` where one fits).

    Raises:
        ShardwiseError: a top in ``to`` is below ``acc``'s own (``to`` must be a MAX).
    """
    to = to.to(INDEX_DTYPE)
    if isinstance(acc, Binned):
        aligned = align(acc, to)  # raises below the binned index itself
        # Copied even where the layout would be a view: the buffer is given back for
        # reuse, and must not alias the accumulator.
        out = buffer((world, 2, acc.numel // world), aligned.bins.device, spare)
        return out.copy_(_planar(aligned.bins, world))
    # One byte an element compared here, not in the pass: a reduction in the pass would be
    # a second loop over the unit recomputing the tops.
    if bool((to < tops(acc)).any()):
        raise ShardwiseError("align: target index below the binned index (it must be a MAX)")
    n = acc.numel
    device = acc.x.device if isinstance(acc, Term) else acc.index.device
    out = buffer((world, 2, n // world), device, spare)
    if isinstance(acc, Term):
        _run("encode_at", _encode_at, n)(acc.x, to, world, out)
    else:
        _run("widen_at", _widen_at, n)(acc.index, acc.value, acc.carry, to, world, out)
    return out


def buffer(shape: tuple[int, ...], device: torch.device,
           spare: list[torch.Tensor] | None = None) -> torch.Tensor:
    """An int64 tensor for the wire or its receiving end: one of that size from ``spare``
    if there is one (Note [aligned wire]: fresh pages cost as much as writing them)."""
    size = math.prod(shape)
    for i, t in enumerate(spare or ()):
        if t.numel() == size and t.device == device:
            assert spare is not None
            return spare.pop(i).view(shape)
    return torch.empty(shape, dtype=torch.int64, device=device)


def give_back(t: torch.Tensor, spare: list[torch.Tensor]) -> None:
    """``t`` (from :func:`buffer`) is no longer read or written by anyone: keep it in
    ``spare`` for the next exchange of that size, on CPU; the ``_SPARES`` most recent ones.
    A caller must not touch it afterwards."""
    if t.device.type != "cpu":  # the CUDA caching allocator reuses memory already
        return
    spare.append(t)
    del spare[:-_SPARES]


# Enough for a unit's wire and receiving end while the next unit's exchange starts, and
# for the root unit's between steps: a bound on what is held however many sizes there are.
_SPARES = 4


def decode(index: torch.Tensor, planes: torch.Tensor, terms: int) -> torch.Tensor:
    """The fp32 sums of ``[2, rows]`` planes at tops ``index`` (``sums.decode``'s bits)."""
    out, flags = _run("decode", _decode_planes, index.shape[0])(index, planes, _F32_OVERFLOW)
    if int(flags) & 1:  # a top sum beyond 53 bits: the integer path
        return _decode_eager(Binned(index, planes.t(), terms), "propagate")
    return out


def wide(acc: Term | Narrow | Binned) -> Binned:
    """The wide state ``acc`` stands for (Note [exact sums]), for a caller that adds it
    to others itself."""
    if isinstance(acc, Term):
        return encode(acc.x)
    if isinstance(acc, Narrow):
        return widen(acc)
    return acc


# -- compiled passes (Note [fused kernels]) ---------------------------------------------------


def _run(name: str, fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``fn`` compiled and checked on the probe, or ``fn`` itself (eager, the same bits)."""
    if n < fused.FUSE_MIN or not fused.enabled():
        return fn
    return fused.kernel(f"wire {name}", fn, lambda c: _matches(name, c), _INLINE) or fn


# Inductor keeps a value read by both slots (the digits) in a temporary tensor once it
# takes more than a few ops; recomputing it per slot is cheaper than a fresh tensor the
# size of the unit (Note [aligned wire]), so the passes writing the wire inline everything.
_INLINE = {"realize_cpu_opcount_threshold": 100_000, "realize_reads_threshold": 100}


def _planar(bins: torch.Tensor, world: int) -> torch.Tensor:
    return bins.view(world, -1, 2).transpose(1, 2)


def _matches(name: str, compiled: Callable[..., Any]) -> bool:
    """Whether a compiled pass gives the wide eager code's bits on the probe (laid out for
    as many ranks, up to 3, as its length allows)."""

    x = fused.probe()
    world = next(w for w in (3, 2, 1) if x.numel() % w == 0)
    own = _encode_eager(x, DEFAULT)
    other = _encode_eager(x.roll(1) * 2.0**35, DEFAULT)
    to = torch.maximum(own.index, other.index)
    if name == "tops":
        return torch.equal(compiled(x), own.index)
    if name in ("encode_at", "widen_at"):
        # A world of one is checked too: dynamic shapes compile the value 1 on its own.
        return all(_lays_out(name, compiled, x, to, other, w) for w in {world, 1})
    total = Binned(to, _align_eager(own, to).bins + _align_eager(other, to).bins, 2)
    out, flags = compiled(total.index, total.bins.t().contiguous(), _F32_OVERFLOW)
    want = _decode_eager(total, "propagate")
    return not int(flags) & 1 and torch.equal(out.view(torch.int32), want.view(torch.int32))


def _lays_out(name: str, compiled: Callable[..., Any], x: torch.Tensor, to: torch.Tensor,
              other: Binned, world: int) -> bool:
    """Whether the compiled ``encode_at`` or ``widen_at`` lays the probe out for ``world``
    ranks with the wide eager code's bits."""
    from .narrow import _probe_state

    bins = torch.empty(world, 2, x.numel() // world, dtype=torch.int64)
    if name == "encode_at":
        compiled(x, to, world, bins)
        return torch.equal(bins, _planar(_align_eager(_encode_eager(x, DEFAULT), to).bins,
                                         world))
    index, value, carry = _probe_state()
    narrow = Narrow(index, value, carry, 3)
    to = torch.maximum(index, other.index)
    compiled(index, value, carry, to, world, bins)
    return torch.equal(bins, _planar(_align_eager(widen(narrow), to).bins, world))
