"""A narrow exact accumulator for micro-batches: 10 bytes an element, the wide form's bits.

Note [narrow accumulator]
=========================
Under ``no_sync`` the reproducible mode used to encode every micro-batch's gradient into
the wide form (Note [exact sums]: an int8 top bin and two int64 bins, 17 bytes an
element) and add it into a wide accumulator: about 70 bytes of memory traffic an element
per micro-batch. This module keeps a rank's running sum narrower, and hands the exchange
exactly the wide state it would have had, so every bit downstream is unchanged.

Representation (``Narrow``), per element: ``index`` (int8) the top bin ``t`` of the wide
state; ``value`` (float64) ``G``; ``carry`` (int8) ``c``. It stands for the wide state

    (t, A, B)  with  A = round(G) + c  and  B = (G - A) * 2**W

(``round`` ties to even; W = 40, the bin width). So ``G`` is the wide state's exact value
``A * 2**P_t + B * 2**P_(t-1)`` in units of ``2**P_t`` (``P_j`` as in Note [exact sums]),
and ``c`` is how far the top slot ``A`` (a sum of per-term roundings) is from the rounding
of that value. The top slot is what a later ``align`` keeps, so it must be known, not
only the value. ``|G - A|`` stays below the number of terms (each term's low part, or
a top slot moved down a bin, is at most one unit), so ``|c|`` does too: one byte holds it
for over a hundred terms, and each pass checks that it does.

Invariant: after ``start(x)`` and each ``add(acc, x)`` whose checks pass, the wide state
the narrow one stands for is exactly ``encode(x)``, resp. ``add(widen(acc), encode(x))``.
Proof for ``add``. The wide add aligns both operands to ``t' = max(t, t_x)`` and adds
them slot by slot. In units of ``2**P_t'``, the accumulator aligned to ``t'`` has top slot
``A`` and value ``G`` if ``t = t'``; top slot 0 and value ``A * 2**-W`` if ``t = t' - 1``
(``A`` moves to the second slot, ``B`` is dropped); 0 and 0 otherwise. ``encode(x)`` is
``(h, l)`` with ``h = round(X)``, ``X = x * 2**-P_tx``, and value exactly ``X`` (encoding
is exact), and aligns the same way. The sum's top slot ``A'`` is the sum of the top slots,
its value ``G'`` the sum of the values. The pass computes exactly these in float64:
scalings by powers of two are exact (no value comes near float64's range limits), so is
``round`` of a float64, ``A`` and ``h`` are integers below ``2**51`` (at most
``MAX_TERMS`` terms of ``|digit| <= 2**40``), and the one operation that can round,
``G' = v_acc + v_x``, is checked: TwoSum gives its rounding error, which must be 0. Then
``c' = A' - round(G')`` (checked to fit int8) stands for that very ``(t', A', B')``.
``start`` is the case of an empty accumulator: ``G = X``, ``c = 0``. ``widen`` recovers
``A`` and ``B``: ``G - A`` is exactly ``B * 2**-W`` (the difference of two float64 values
that is itself a float64 value, as ``|B| < 2**51``), so the subtraction is exact.

When a check fails (``G'`` not exact: the element's kept bits span more than float64's
53; ``|c'| > 127``; an inf or NaN term; more than ``MAX_TERMS`` terms) the whole
accumulator falls back: ``widen`` of the previous, valid narrow state (exact, by the
invariant), then the wide ``encode``/``add_`` of this term and of every later one. The
decision is made by one rank about its own terms, but it never changes a bit: either way
the exchange receives the same wide state, and the wide form's result is a function of
the multiset of terms (Note [exact sums]). Ranks may differ in which form they used; the
wire carries the wide form always (``exchange`` widens a narrow accumulator first).

Costs: 10 bytes an element held instead of 17; one fused pass per micro-batch reads the
fp32 gradient and the narrow state and writes the narrow state (24 bytes an element),
where the wide path encoded (21) and added (50). The last micro-batch's pass ends in the
narrow state too: the exchange widens it aligned to every rank's tops in one pass (Note
[aligned wire] in exact/wire.py; ``add_widen`` is the one-pass widen at the rank's own
tops, kept for benchmarks/exact_sum.py). Like Note [fused kernels], the passes run compiled
and are checked bit for bit against these eager ops on ``fused.probe()`` before first
use; below ``fused.FUSE_MIN`` elements, without a compiler, or with
``SHARDWISE_NARROW=0`` the wide path runs as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import ShardwiseError
from . import fused
from .sums import DEFAULT, INDEX_DTYPE, Binned, add_, check_terms, encode

__all__ = ["MAX_TERMS", "Narrow", "Term", "accumulate", "add", "add_widen", "start", "wanted",
           "widen"]

MAX_TERMS = 1024  # keeps A, B below 2**51: exact in float64 (Note [narrow accumulator])
_W, _BASE = DEFAULT.W, DEFAULT.base


@dataclass
class Narrow:
    """A rank's running exact sum of ``terms`` fp32 tensors (Note [narrow accumulator])."""

    index: torch.Tensor  # int8 [n]: top bin t
    value: torch.Tensor  # float64 [n]: G, the wide state's exact value in units 2**P_t
    carry: torch.Tensor  # int8 [n]: c, the top slot is round(G) + c
    terms: int = 1

    @property
    def numel(self) -> int:
        return self.index.shape[0]


@dataclass
class Term:
    """One micro-batch's fp32 gradient (flat, rank-major), not encoded yet: the exchange
    encodes it at every rank's tops in one pass (Note [aligned wire] in exact/wire.py)."""

    x: torch.Tensor
    terms: int = 1

    @property
    def numel(self) -> int:
        return self.x.shape[0]


def wanted(n: int) -> bool:
    """Whether a unit of ``n`` elements accumulates narrowly. ``SHARDWISE_NARROW``: ``0``
    never; ``1`` (default) from ``fused.FUSE_MIN`` elements on, where the passes compile
    (the eager passes are slower than the wide form's eager ops); ``all`` at every size,
    eagerly below ``FUSE_MIN`` (tests run the engine's small models through it so)."""
    mode = os.environ.get("SHARDWISE_NARROW", "1")
    if mode == "all":
        return True
    # Compiled, or not at all: the eager passes are slower than the wide eager ops.
    return (mode != "0" and n >= fused.FUSE_MIN and fused.enabled()
            and _run("step", _step, n) is not _step)


# -- the passes, as plain torch ops (the specification; compiled by _kernel) ------------------


def _top(x: torch.Tensor) -> torch.Tensor:
    """Each fp32 element's top bin as ``encode`` gives it (int64; 0 for +-0, NONFINITE
    for inf and NaN)."""
    bits = x.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    lead = biased.clamp(min=1) - 127  # floor(log2|x|); -126 for subnormals
    top = torch.div(lead + 126, _W, rounding_mode="floor") + 1
    top = torch.where((bits & 0x7FFFFFFF) != 0, top, 0)
    return torch.where(biased == 0xFF, fused.NONFINITE, top).to(torch.int64)


def _scale(t: torch.Tensor) -> torch.Tensor:
    """``2**-P_t`` in float64, exactly: to the units of bin ``t``."""
    return fused.pow2(-(_BASE + t * _W))


_DOWN = 2.0**-_W  # one bin down: units of bin t to units of bin t + 1


def _start(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    t = _top(x)
    bad = t == fused.NONFINITE
    t = torch.where(bad, 0, t)
    value = torch.where(bad, 0.0, x.to(torch.float64)) * _scale(t)
    return (t.to(INDEX_DTYPE), value, torch.zeros_like(t, dtype=INDEX_DTYPE), bad.any())


def _step(index: torch.Tensor, value: torch.Tensor, carry: torch.Tensor,
          x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One term added: the new (t', G', c') and a flag for any element failing a check."""
    t2, s, c, fail = _step_elementwise(index, value, carry, x)
    return t2, s, c, fail.any()


def _step_elementwise(index: torch.Tensor, value: torch.Tensor, carry: torch.Tensor,
                      x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``_step`` with the failed checks per element."""
    tx = _top(x)
    t = index.to(torch.int64)
    bad = tx == fused.NONFINITE
    tx = torch.where(bad, 0, tx)
    xs = torch.where(bad, 0.0, x.to(torch.float64)) * _scale(tx)  # x in units of bin tx
    h = torch.round(xs)                         # the term's top slot
    a = torch.round(value) + carry.to(torch.float64)  # the accumulator's top slot
    t2 = torch.maximum(t, tx)
    da, dx = t2 - t, t2 - tx
    # Each operand aligned to t2, in units of bin t2: itself, its top slot one bin down
    # (the next slot keeps it, what was below is dropped), or nothing.
    v_acc = torch.where(da == 0, value, torch.where(da == 1, a * _DOWN, 0.0))
    v_x = torch.where(dx == 0, xs, torch.where(dx == 1, h * _DOWN, 0.0))
    top = torch.where(da == 0, a, 0.0) + torch.where(dx == 0, h, 0.0)
    s = v_acc + v_x
    back = s - v_acc
    err = (v_acc - (s - back)) + (v_x - back)  # TwoSum: the exact rounding error of s
    c = top - torch.round(s)
    fail = bad | (err != 0) | (c.abs() > 127)
    c = c.clamp(-127, 127)
    return t2.to(INDEX_DTYPE), s, c.to(INDEX_DTYPE), fail


def _widen(index: torch.Tensor, value: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    a = torch.round(value) + carry.to(torch.float64)
    b = (value - a) * float(2**_W)
    return torch.stack([a.to(torch.int64), b.to(torch.int64)], dim=1)


def _step_widen(index: torch.Tensor, value: torch.Tensor, carry: torch.Tensor,
                x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``_step`` then ``_widen``, in one pass (``add_widen``)."""
    t2, s, c, fail = _step(index, value, carry, x)
    return t2, _widen(t2, s, c), fail


# -- public operations -----------------------------------------------------------------------


def start(x: torch.Tensor) -> Narrow | None:
    """The first term (fp32, flat), or None if it holds inf or NaN (use the wide form)."""
    index, value, carry, bad = _run("start", _start, x.numel())(x)
    return None if bool(bad) else Narrow(index, value, carry, 1)


def add(acc: Narrow, x: torch.Tensor) -> Narrow | None:
    """``acc`` plus the term ``x``, or None where a check fails (then widen ``acc`` and add
    ``x`` in the wide form; Note [narrow accumulator])."""
    if acc.terms + 1 > MAX_TERMS:
        return None
    index, value, carry, fail = _run("step", _step, acc.numel)(acc.index, acc.value, acc.carry, x)
    return None if bool(fail) else Narrow(index, value, carry, acc.terms + 1)


def add_widen(acc: Narrow, x: torch.Tensor) -> Binned | None:
    """``widen(add(acc, x))`` in one pass, or None where a check fails."""
    if acc.terms + 1 > MAX_TERMS:
        return None
    index, bins, fail = _run("step_widen", _step_widen, acc.numel)(
        acc.index, acc.value, acc.carry, x)
    return None if bool(fail) else Binned(index, bins, acc.terms + 1, DEFAULT)


def widen(acc: Narrow) -> Binned:
    """The wide form (Note [exact sums]) that ``acc`` stands for, exactly."""
    check_terms(acc.terms)
    bins = _run("widen", _widen, acc.numel)(acc.index, acc.value, acc.carry)
    return Binned(acc.index, bins, acc.terms, DEFAULT)


def accumulate(acc: Narrow | Binned | Term | None, x: torch.Tensor, *,
               final: bool) -> Narrow | Binned | Term:
    """``acc`` plus one more term ``x`` (a flat fp32 gradient), in whichever form is exact
    and cheapest. ``final`` (the reducing backward's term): the result is what
    ``exact.reduce.exchange`` sends, which lays it out aligned to every rank's tops in one
    pass (Note [aligned wire] in exact/wire.py): a ``Term`` if ``x`` is the only one, else
    the narrow state, or the wide one after a fallback. The wide state is the same either
    way, so the result's bits are (Note [narrow accumulator]).

    Example:
        >>> acc = None
        >>> for i, g in enumerate(grads):
        ...     acc = accumulate(acc, g, final=i == len(grads) - 1)
    """
    x = x.reshape(-1)
    if x.dtype != torch.float32:
        raise ShardwiseError(f"exact accumulate: gradients reach it as fp32 (the engine's "
                             f"rank-major buffer), got {x.dtype}; pass x.float()")
    if acc is None:
        if not wanted(x.numel()):
            return encode(x)
        if final:
            return Term(x)
        return start(x) or encode(x)
    if isinstance(acc, Term):  # kept after an exchange that refused to start: rare
        acc = encode(acc.x)
    if isinstance(acc, Narrow):
        nxt = add(acc, x)
        if nxt is not None:
            return nxt
        acc = widen(acc)  # fallback: exact, and the wide path from here on
    return add_(acc, encode(x))


# -- compiled passes (Note [fused kernels]) ---------------------------------------------------


def _run(name: str, fn, n: int):
    """``fn`` compiled and checked on the probe, or ``fn`` itself (eager, the same bits)."""
    if n < fused.FUSE_MIN or not fused.enabled():
        return fn
    return fused.kernel(f"narrow {name}", fn, lambda c: _matches(fn, c)) or fn


def _probe_state() -> tuple[torch.Tensor, ...]:
    """A narrow state of every kind on the probe: three terms summed eagerly, where an
    element fails a check it keeps its previous state (so later passes see valid ones)."""
    x = fused.probe()
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    index, value, carry, _ = _start(x)
    for shift in (1, 7):
        i2, v2, c2, fail = _step_elementwise(index, value, carry, x.roll(shift))
        index, value, carry = (torch.where(fail, index, i2), torch.where(fail, value, v2),
                               torch.where(fail, carry, c2))
    return index, value, carry


def _matches(fn, compiled) -> bool:
    """Whether the compiled pass gives the eager pass's bits on the probe."""
    index, value, carry = _probe_state()
    x = fused.probe(seed=1)
    if fn is _start:
        args: tuple[torch.Tensor, ...] = (x,)
    elif fn is _widen:
        args = (index, value, carry)
    else:
        args = (index, value, carry, x)
    want, got = fn(*args), compiled(*args)
    if isinstance(want, torch.Tensor):
        want, got = (want,), (got,)
    return all(_same_bits(w, g) for w, g in zip(want, got))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float64:
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    return torch.equal(a, b)
