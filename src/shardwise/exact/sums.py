"""Order-independent sums of fp32 tensors in fixed bins (the numeric core of issue 24).

Note [exact sums]
=================
Goal: the elementwise sum of M fp32 tensors (one micro-batch gradient each) must have the same
bits however the terms are grouped on ranks and in whatever order groups are added. Floating
point addition is not associative, so the terms are turned into integers on a grid that
depends only on the values, and integers are added instead.

Representation (``Binned``). The real line is cut into bins of ``W`` bits at fixed exponents:
bin ``j`` holds bit positions ``[P_j, P_j + W)`` with ``P_j = BASE + j*W`` and
``BASE = -126 - W``. Bin 1 starts at 2**-126 (subnormals lie in bins 0 and 1), and the
highest fp32 bit (2**127) lies in bin ``1 + (127 + 126) // W``. Per element we keep

* ``index`` (int8, shape ``[n]``): the top bin ``t``. ``t`` of one term is the bin of its
  leading exponent (``floor(log2|x|)``, -126 for subnormals); 0 for zero. The index of a sum
  is the MAX of its terms' indices (or a block's shared MAX, see below).
* ``bins`` (int64, shape ``[n, K]``, element-major): ``bins[i, k]`` is an accumulator for
  bin ``index[i] - k``. Element-major means that a contiguous range of elements is a
  contiguous range of memory, so ``bins.view(-1)`` can be reduce-scattered over elements.

Each finite term ``x`` has a fixed *balanced digit expansion* ``x = sum_j d_j(x) * 2**P_j``
computed top-down from its own index: ``d = round_half_even(r / 2**P_j)``, ``r -= d*2**P_j``.
So ``|d_j| <= 2**(W-1)`` below the top and ``|d_top| < 2**W``. With ``(K-1)*W >= 24`` the whole
24-bit significand fits in its own K bins: encoding is exact.

Invariant. A ``Binned`` with index ``t`` holds, in slot ``k``, exactly
``sum over its terms i of d_{t-k}(x_i)``, an integer sum. It holds after ``encode``. ``align``
to ``t' >= t`` moves slots down by ``t' - t``: bins above ``t`` get 0 (no term has a digit
above its own index, which is ``<= t``) and bins below ``t' - K + 1`` are dropped. ``add``
aligns both to the MAX of their indices and adds slot by slot. Integer addition is exact,
associative and commutative, and MAX is too, so the final state is ``T = max_i t_i`` together
with the K sums ``sum_i d_j(x_i)`` for ``j`` in ``(T-K, T]``: a function of the multiset of
terms, not of grouping or order. ``decode`` is a function of that state alone.

What is kept. Each term contributes ``x`` rounded to the nearest multiple of
``2**P_{T-K+1}`` (ties to even): the kept digits of a balanced expansion are that rounding,
because everything above the cut is an even multiple of the cut's unit. ``T`` is the bin of
the largest term's leading bit, so the largest term has at least ``(K-1)*W + 1`` bits kept
and every term is off by at most ``2**(P_T - (K-1)*W - 1) <= max|x| * 2**-((K-1)*W + 1)``.
``decode`` rounds the exact kept sum to fp32 with round-to-nearest-even (correctly rounded),
via an exact 53-bit round-to-odd intermediate. An exact zero decodes to +0.0 (fp32 gives
-0.0 for a sum of only -0.0; the sign of zero is not kept).

Why no carries between bins. Moving ``c * 2**W`` from bin j into bin j+1 keeps the value but
changes what a later ``align`` drops: keeping ``sum_{j >= L} A_j 2**P_j`` for every possible
cut ``L`` forces every ``A_j`` to stay as it is. So each int64 accumulator keeps its own carry
in its ``63 - W`` spare bits, and the number of terms is bounded instead: with
``|digit| < 2**W``, ``n <= max_terms() = 2**(62 - W)`` terms keep every accumulator within
``2**62`` (one spare bit for the carries ``decode`` resolves). ``Binned.terms`` counts terms
and ``add`` raises beyond the bound; a caller that sums bins itself (an integer reduce-scatter)
must pass the summed count to ``check_terms``.

Non-finite terms propagate deterministically. A term inf or NaN gets the index ``NONFINITE``
(127, above every finite index, so a MAX spreads it), slot 0 counts +inf, slot 1 counts -inf,
and NaN counts as both. Aligning a finite element to ``NONFINITE`` zeroes it. ``decode`` gives
NaN if both counts are positive (or both zero, see below), else inf of the counted sign: IEEE's
answer (with a canonical NaN) for any order. A decoded sum beyond fp32's range gives +-inf
under round-to-nearest, deterministically (the sum is exact, so ``max + max - max`` gives max
where a sequential fp32 sum may give inf). ``decode(..., nonfinite="raise")`` raises
``ShardwiseError`` instead, naming the elements that were inf/NaN or overflowed.

Shared index. ``block_index``/``expand_index`` let a block of elements share the MAX of their
indices (fewer index bytes on the wire). Each element then keeps bits relative to its block's
largest term: still a function of the values, so still order-independent, but less accurate
for elements much smaller than their block's largest. A non-finite term makes its whole
block ``NONFINITE``; its finite elements then decode to NaN (both counts zero), never to a
silently wrong number.

Defaults and costs. ``K = 2, W = 40``: each term keeps 40 bits below the top bin, 16 more than
fp32's 24, so the dropped part is at most ``M * 2**-41`` of the largest term (against fp32's
``2**-25`` of the result for one rounding); up to ``2**22`` (4M) terms between decodes. On the
wire: 16 bytes of bins + 1 byte of index per element (4.25x an fp32 reduce-scatter), or
16 + 1/B with a block of B elements sharing an index. Above ``fused.FUSE_MIN`` elements
the K=2 operations run as compiled kernels with the same bits (Note [fused kernels]); the
time each takes is in BENCHMARKS.md ("Exact sums").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..errors import ShardwiseError
from . import fused

__all__ = [
    "NONFINITE",
    "Binned",
    "Spec",
    "add",
    "add_",
    "align",
    "block_index",
    "check_terms",
    "decode",
    "encode",
    "expand_index",
    "max_terms",
    "zeros",
]

NONFINITE = fused.NONFINITE  # an element with an inf or NaN term; above every finite index
INDEX_DTYPE = torch.int8


@dataclass(frozen=True)
class Spec:
    """Bin layout: ``K`` kept bins of ``W`` bits each."""

    K: int = 2
    W: int = 40

    def __post_init__(self) -> None:
        # (K-1)*W >= 24: a term's 24-bit significand fits below its top bin, so encoding is
        # exact. W <= 52: digits are exact in float64 during encoding. K >= 2: the non-finite
        # counts need two slots.
        if self.K < 2 or not 1 <= self.W <= 52 or (self.K - 1) * self.W < 24:
            raise ValueError(f"unsupported bin spec K={self.K}, W={self.W}")

    @property
    def base(self) -> int:
        """``P_0``, the lowest bit position of bin 0 (bin 1 starts at 2**-126)."""
        return -126 - self.W

    @property
    def top_index(self) -> int:
        """Index of the bin that holds fp32's highest bit, 2**127."""
        return 1 + (127 + 126) // self.W

    @property
    def wire_bytes(self) -> int:
        """Bytes per element on the wire with a per-element index."""
        return 8 * self.K + 1


DEFAULT = Spec()


def max_terms(spec: Spec = DEFAULT) -> int:
    """How many encoded terms one ``Binned`` may hold before int64 headroom runs out."""
    return 1 << (62 - spec.W)


def check_terms(terms: int, spec: Spec = DEFAULT) -> None:
    """Raise if ``terms`` encoded tensors summed into one ``Binned`` could overflow int64."""
    if terms > max_terms(spec):
        raise ShardwiseError(
            f"exact sum of {terms} terms exceeds the int64 headroom of bins of {spec.W} bits "
            f"({max_terms(spec)} terms at most); decode before adding more"
        )


@dataclass
class Binned:
    """A binned sum of ``terms`` fp32 tensors of ``n`` elements (see Note [exact sums])."""

    index: torch.Tensor  # int8 [n]: top bin per element
    bins: torch.Tensor  # int64 [n, K]: bins[:, k] accumulates bin index - k
    terms: int = 1
    spec: Spec = field(default=DEFAULT)

    def __post_init__(self) -> None:
        n = self.index.shape[0]
        if self.index.dtype != INDEX_DTYPE or self.index.dim() != 1:
            raise ShardwiseError(f"Binned.index must be 1-D {INDEX_DTYPE}, got {self.index.dtype}")
        if self.bins.dtype != torch.int64 or tuple(self.bins.shape) != (n, self.spec.K):
            raise ShardwiseError(
                f"Binned.bins must be int64 of shape ({n}, {self.spec.K}), "
                f"got {self.bins.dtype} {tuple(self.bins.shape)}"
            )
        check_terms(self.terms, self.spec)

    @property
    def numel(self) -> int:
        return self.index.shape[0]


def zeros(n: int, spec: Spec = DEFAULT, device: torch.device | str = "cpu") -> Binned:
    """The empty sum (index 0, all bins 0, no terms): a start for accumulation."""
    return Binned(
        torch.zeros(n, dtype=INDEX_DTYPE, device=device),
        torch.zeros(n, spec.K, dtype=torch.int64, device=device),
        terms=0,
        spec=spec,
    )


def encode(x: torch.Tensor, spec: Spec = DEFAULT) -> Binned:
    """Encode a tensor (fp32, or bf16/fp16 widened exactly to fp32) as one exact term.

    The result is flattened (``x.reshape(-1)``). Encoding is exact for finite values; inf and
    NaN become counts at index ``NONFINITE``.
    """
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()  # exact: every bf16/fp16 value is an fp32 value
    if x.dtype != torch.float32:
        raise ShardwiseError(f"exact sums take fp32, bf16 or fp16 tensors, got {x.dtype}")
    x = x.reshape(-1)
    run = _fused("encode", x.numel(), spec)
    if run is not None:
        index, bins = run(x.contiguous(), spec.W)
        return Binned(index, bins, terms=1, spec=spec)
    return _encode_eager(x, spec)


def _encode_eager(x: torch.Tensor, spec: Spec) -> Binned:
    K, W = spec.K, spec.W
    biased = (x.view(torch.int32) >> 23) & 0xFF  # exponent field
    finite = biased != 0xFF
    # Leading exponent floor(log2|x|) for normals, -126 for subnormals: a fixed function of x.
    lead = biased.clamp(min=1).to(torch.int64) - 127
    top = torch.div(lead + 126, W, rounding_mode="floor") + 1
    top = torch.where((x != 0) & finite, top, torch.zeros_like(top))
    r = torch.where(finite, x, torch.zeros_like(x)).to(torch.float64)  # exact
    # Scaled so that bin t's unit is 1. Scaling by powers of two and subtracting the rounded
    # part are exact in float64 (<= 53 bits), and round-half-even gives the balanced digit,
    # so the kept digits of any cut are a round-to-nearest of x (Note [exact sums]).
    r = r * fused.pow2(-(spec.base + top * W))
    bins = torch.empty(x.shape[0], K, dtype=torch.int64, device=x.device)
    for k in range(K):
        d = torch.round(r) if k < K - 1 else r  # the last slot is an integer: encoding is exact
        bins[:, k] = d.to(torch.int64)
        if k < K - 1:
            r = (r - d) * float(2**W)
    index = top.to(INDEX_DTYPE)
    if not bool(finite.all()):
        bad = ~finite
        nan = torch.isnan(x)
        pos_count = (bad & ((x > 0) | nan)).to(torch.int64)
        neg_count = (bad & ((x < 0) | nan)).to(torch.int64)
        bins[bad] = 0
        bins[:, 0] += pos_count
        bins[:, 1] += neg_count
        index = torch.where(bad, torch.full_like(index, NONFINITE), index)
    return Binned(index, bins, terms=1, spec=spec)


def _shift_slots(bins: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Slot ``k`` of the result is slot ``k - shift`` of ``bins`` (0 where that is < 0)."""
    K = bins.shape[1]
    out = torch.zeros_like(bins)
    for k in range(K):  # K is 2 or 3: a loop over slots, never over elements
        for s in range(k + 1):
            out[:, k] += torch.where(shift == s, bins[:, k - s], 0)
    return out


def align(b: Binned, index: torch.Tensor) -> Binned:
    """``b`` moved to the top bins ``index`` (each >= ``b.index``), dropping bins below them.

    This is what a rank does after the all-reduce MAX of indices and before the integer
    reduce-scatter of the bins. Raises if an ``index`` is below ``b.index`` (that would drop
    top bits, not low ones).
    """
    index = index.to(INDEX_DTYPE)
    if index.shape != b.index.shape:
        raise ShardwiseError(f"align: index of shape {tuple(index.shape)} for {b.numel} elements")
    if torch.equal(index, b.index):  # the usual case: nothing moves
        return Binned(index, b.bins, b.terms, b.spec)
    run = _fused("align", b.numel, b.spec)
    if run is not None:
        bins, below = run(b.index, b.bins, index)
        if bool(below):
            raise ShardwiseError("align: target index below the binned index (it must be a "
                                 "MAX)")
        return Binned(index, bins, b.terms, b.spec)
    return _align_eager(b, index)


def _align_eager(b: Binned, index: torch.Tensor) -> Binned:
    shift = index.to(torch.int64) - b.index.to(torch.int64)
    if bool((shift < 0).any()):
        raise ShardwiseError("align: target index below the binned index (it must be a MAX)")
    if not bool(shift.any()):
        return Binned(index, b.bins, b.terms, b.spec)
    return Binned(index, _shift_slots(b.bins, shift), b.terms, b.spec)


def add(a: Binned, b: Binned) -> Binned:
    """Exact sum of two binned forms: associative and commutative, bit for bit."""
    if a.spec != b.spec:
        raise ShardwiseError(f"add: bin specs differ ({a.spec} and {b.spec})")
    check_terms(a.terms + b.terms, a.spec)
    if torch.equal(a.index, b.index):  # the usual case: the same tops, an integer add
        return Binned(a.index.clone(), a.bins + b.bins, a.terms + b.terms, a.spec)
    run = _fused("merge", a.numel, a.spec)
    if run is not None:
        index, bins = run(a.index, a.bins, b.index, b.bins)
        return Binned(index, bins, a.terms + b.terms, a.spec)
    return _add_eager(a, b)


def _add_eager(a: Binned, b: Binned) -> Binned:
    index = torch.maximum(a.index, b.index)
    aa, bb = align(a, index), align(b, index)
    return Binned(index, aa.bins + bb.bins, a.terms + b.terms, a.spec)


def add_(acc: Binned, b: Binned) -> Binned:
    """``acc = add(acc, b)`` in ``acc`` (the no_sync accumulator): in place when the tops
    agree (the usual case, an integer add), else ``acc`` takes the sum's tensors."""
    if acc.spec != b.spec:
        raise ShardwiseError(f"add_: bin specs differ ({acc.spec} and {b.spec})")
    check_terms(acc.terms + b.terms, acc.spec)
    if torch.equal(acc.index, b.index):
        acc.bins += b.bins
    else:
        total = add(acc, b)
        acc.index, acc.bins = total.index, total.bins
    acc.terms += b.terms
    return acc


def block_index(index: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block MAX of a per-element index (the last block may be short): what to send."""
    n = index.shape[0]
    pad = (-n) % block
    padded = torch.cat([index, index.new_zeros(pad)]) if pad else index
    return padded.view(-1, block).amax(dim=1)


def expand_index(blocks: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Per-element index from a per-block one (the inverse of ``block_index``'s layout)."""
    return blocks.repeat_interleave(block)[:n]


def _bit_length(v: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative int64 values (0 for 0)."""
    _, e = torch.frexp(v.to(torch.float64))
    e = e.to(torch.int64)
    # The float64 conversion may round up to the next power of two, never down below it.
    high = (e > 0) & ((v >> (e - 1).clamp(0, 63)) == 0)
    return e - high.to(torch.int64)


def _carry(slots: list[torch.Tensor], W: int) -> None:
    """Exact carry propagation: slots 1.. into [0, 2**W), slot 0 takes the rest (signed)."""
    for k in range(len(slots) - 1, 0, -1):
        c = slots[k] >> W  # floor division: arithmetic shift
        slots[k] = slots[k] - (c << W)
        slots[k - 1] = slots[k - 1] + c


def _round_to_odd_fast(bins: torch.Tensor, bottom: torch.Tensor, W: int) -> torch.Tensor | None:
    """K=2: the exact sum rounded to odd in float64, or None when a top sum needs > 53 bits.

    After one carry the value is ``hi + lo`` with both parts exact in float64; TwoSum gives
    the rounded sum and its exact error, and a non-zero error moves an even result one ulp
    towards it (round to odd).
    """
    c = bins[:, 1] >> W
    lo_i = bins[:, 1] - (c << W)
    hi_i = bins[:, 0] + c
    if bool((hi_i.abs() >= 2**53).any()):
        return None
    unit = fused.pow2(bottom)
    hi = hi_i.to(torch.float64) * (unit * float(2**W))
    lo = lo_i.to(torch.float64) * unit
    s = hi + lo
    back = s - hi
    err = (hi - (s - back)) + (lo - back)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.copysign(torch.full_like(s, float("inf")), err)
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s)


def _round_to_odd(bins: torch.Tensor, bottom: torch.Tensor, W: int) -> torch.Tensor:
    """Any K, any headroom: the exact sum rounded to odd at 53 bits, in integers."""
    K = bins.shape[1]
    slots = [bins[:, k].clone() for k in range(K)]
    _carry(slots, W)
    neg = slots[0] < 0
    # Magnitude: negate every slot of a negative value and carry again, so that all slots
    # are non-negative with slots 1.. below 2**W.
    slots = [torch.where(neg, -s, s) for s in slots]
    _carry(slots, W)
    # Bit length of the magnitude counted from the bottom of slot K-1.
    length = torch.zeros_like(slots[0])
    for k in range(K):
        lk = _bit_length(slots[k]) + (K - 1 - k) * W
        length = torch.maximum(length, torch.where(slots[k] > 0, lk, 0))
    # Keep the top 53 bits and OR every lower bit into the last one (round to odd).
    start = (length - 53).clamp(min=0)
    window = torch.zeros_like(start)
    sticky = torch.zeros_like(start, dtype=torch.bool)
    for k in range(K):
        sh = (K - 1 - k) * W - start
        left = slots[k] << sh.clamp(0, 62)
        right_by = (-sh).clamp(0, 63)
        right = slots[k] >> right_by
        mask = torch.bitwise_left_shift(torch.ones_like(right_by), right_by) - 1
        lost = torch.where(right_by >= 63, slots[k], slots[k] & mask)
        window = window | torch.where(sh >= 0, left, right)
        sticky = sticky | ((sh < 0) & (lost != 0))
    window = window | sticky.to(torch.int64)
    mag = window.to(torch.float64) * fused.pow2(start + bottom)  # exact: <= 53 bits, in range
    return torch.where(neg, -mag, mag)


_F32_OVERFLOW = 2.0**128 - 2.0**103  # RNE rounds values >= this (midpoint past max) to inf


def decode(b: Binned, *, nonfinite: Literal["propagate", "raise"] = "propagate") -> torch.Tensor:
    """The fp32 sum, correctly rounded (to nearest, ties to even) from the exact kept sum.

    ``nonfinite="propagate"`` gives NaN/inf for elements with NaN/inf terms and +-inf for
    sums beyond fp32's range; ``"raise"`` raises ``ShardwiseError`` naming them instead.
    """
    check_terms(b.terms, b.spec)
    run = _fused("decode", b.numel, b.spec)
    if run is not None:
        out, big, any_bad, any_over = run(b.index, b.bins, b.spec.W, b.spec.base,
                                          _F32_OVERFLOW)
        if not bool(big) and not (nonfinite == "raise" and bool(any_bad | any_over)):
            return out
    return _decode_eager(b, nonfinite)


def _decode_eager(b: Binned, nonfinite: Literal["propagate", "raise"]) -> torch.Tensor:
    K, W = b.spec.K, b.spec.W
    bad = b.index == NONFINITE
    top = torch.where(bad, 0, b.index.to(torch.int64))  # keep pow2 in range; bad is replaced
    bottom = b.spec.base + (top - (K - 1)) * W  # P of slot K-1
    ro = _round_to_odd_fast(b.bins, bottom, W) if K == 2 else None
    if ro is None:
        ro = _round_to_odd(b.bins, bottom, W)
    # ro holds the exact sum rounded to odd at 53 bits: a round-to-nearest-even to 24 bits
    # (or fewer, for subnormals) from it is the correct rounding of the exact sum.
    over = ro.abs() >= _F32_OVERFLOW
    out = ro.to(torch.float32)
    out = torch.where(over, torch.copysign(torch.full_like(out, float("inf")), out), out)
    any_bad = bool(bad.any())
    if nonfinite == "raise" and (any_bad or bool(over.any())):
        raise ShardwiseError(_nonfinite_message(b, bad, over & ~bad))
    if any_bad:
        pos = b.bins[:, 0] > 0
        negc = b.bins[:, 1] > 0
        # Both counts zero happens only with a shared block index: a finite element whose
        # block has a non-finite term; its value is lost, so it is NaN, never a silent number.
        special = torch.where(
            pos == negc,
            torch.full_like(out, float("nan")),
            torch.where(pos, float("inf"), float("-inf")).to(out.dtype),
        )
        out = torch.where(bad, special, out)
    return out


def _nonfinite_message(b: Binned, bad: torch.Tensor, over: torch.Tensor) -> str:
    parts = []
    if bool(bad.any()):
        pos = b.bins[:, 0] > 0
        negc = b.bins[:, 1] > 0
        nan = bad & pos & negc
        inf = bad & ~(pos & negc)
        first = int(bad.nonzero()[0, 0])
        parts.append(
            f"{int(nan.sum())} elements with NaN (or +inf and -inf) terms and {int(inf.sum())} "
            f"with inf terms (first at element {first})"
        )
    if bool(over.any()):
        first = int(over.nonzero()[0, 0])
        parts.append(
            f"{int(over.sum())} elements whose sum overflows fp32 (first at element {first})"
        )
    return f"exact sum of {b.terms} terms over {b.numel} elements: " + "; ".join(parts)


# -- fused kernels (Note [fused kernels] in fused.py) ----------------------------------------

_KERNELS: dict[str, Callable[..., Any]] = {
    "encode": fused.encode2, "merge": fused.merge2, "align": fused.align2,
    "decode": fused.decode2}


def _fused(name: str, n: int, spec: Spec):
    """The compiled kernel ``name`` for ``n`` elements, or None (eager code runs)."""
    if spec != DEFAULT or n < fused.FUSE_MIN or not fused.enabled():
        return None
    return fused.kernel(name, _KERNELS[name], lambda compiled: _matches(name, compiled))


def _matches(name: str, compiled) -> bool:
    """Whether ``compiled`` gives the eager code's bits on the probe."""
    x = fused.probe()
    a, b = _encode_eager(x, DEFAULT), _encode_eager(x.roll(1), DEFAULT)
    if name == "encode":
        index, bins = compiled(x, DEFAULT.W)
        return torch.equal(index, a.index) and torch.equal(bins, a.bins)
    if name == "merge":
        index, bins = compiled(a.index, a.bins, b.index, b.bins)
        want = _add_eager(a, b)
        return torch.equal(index, want.index) and torch.equal(bins, want.bins)
    if name == "align":
        to = torch.maximum(a.index, b.index)
        bins, below = compiled(a.index, a.bins, to)
        return torch.equal(bins, _align_eager(a, to).bins) and not bool(below)
    total = _add_eager(_add_eager(a, b), _encode_eager(x.roll(7), DEFAULT))
    out, big, _, _ = compiled(total.index, total.bins, DEFAULT.W, DEFAULT.base, _F32_OVERFLOW)
    decoded = _decode_eager(total, "propagate")
    return not bool(big) and torch.equal(out.view(torch.int32), decoded.view(torch.int32))
