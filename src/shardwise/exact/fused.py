"""Fused kernels for the default bin layout (K=2): the reproducible mode's elementwise
passes, each compiled into one loop over the elements.

Note [fused kernels]
Encoding, adding and decoding binned sums are each a dozen elementwise torch ops. Run one
by one, they read and write the whole gradient a dozen times, and the reproducible mode
spent most of its time there (BENCHMARKS.md, "Exact sums"). ``torch.compile`` (inductor)
fuses each chain into one loop. Every op in these kernels is an integer op or an exact
float64 op (a product by a power of two, a sum whose error TwoSum recovers, nextafter),
and inductor compiles without reassociation or contraction (unsafe-math and fp-contract
are off by default), so the fused loop gives the unfused ops' bits.

That is checked, not assumed: before a kernel is first used in a process, its compiled
form runs on a probe holding every kind of input (zeros of both signs, subnormals, each
exponent with tie and near-tie significands, inf, NaN, random bit patterns) and must give
the eager code's bits exactly (sums.py supplies the comparison). A compile that fails, a
mismatch, or ``SHARDWISE_FUSED=0`` leaves the eager code in charge, with one warning for
the first two. Tensors below ``FUSE_MIN`` elements always run eagerly: a compile (seconds,
once per process, cached on disk by inductor) is not worth it for them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from .._log import logger

FUSE_MIN = 1 << 16
NONFINITE = 127  # the index of an element with an inf or NaN term (sums.NONFINITE)
_kernels: dict[str, Callable | None] = {}


def enabled() -> bool:
    """``SHARDWISE_FUSED``: the fused kernels are used unless it is ``0``."""
    return os.environ.get("SHARDWISE_FUSED", "1") != "0"


def kernel(name: str, fn: Callable, matches: Callable[[Callable], bool],
           options: dict | None = None) -> Callable | None:
    """``fn`` compiled, once per process, if ``matches(compiled)`` holds; else None (the
    caller then runs its eager code). ``options``: inductor's, for this kernel. Never
    raises."""
    if name in _kernels:
        return _kernels[name]
    compiled = None
    if enabled():
        try:
            candidate = torch.compile(fn, dynamic=True, fullgraph=True, options=options)
            if matches(candidate):
                compiled = candidate
            else:
                warnings.warn(f"shardwise: the fused {name} kernel gave other bits than the "
                              f"eager code on its probe; the eager code runs instead "
                              f"(slower, same results). Please report this.", stacklevel=2)
        except Exception as e:  # noqa: BLE001 - no compiler, an inductor bug: run eagerly
            warnings.warn(f"shardwise: could not compile the fused {name} kernel "
                          f"({type(e).__name__}: {str(e)[:200]}); the eager code runs instead "
                          f"(slower, same results). SHARDWISE_FUSED=0 skips the attempt.",
                          stacklevel=2)
    logger.info("exact sums: fused %s kernel %s", name, "on" if compiled else "off")
    _kernels[name] = compiled
    return compiled


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 ``2**e`` for integer ``e`` in [-1022, 1023], built from the bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def encode2(x: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Note [exact sums]'s encoding for K=2, in integers: the balanced digits of each
    fp32 significand against its top bin, and the non-finite counts."""
    top, b0, b1 = digits2(x, W)
    return top.to(torch.int8), torch.stack([b0, b1], dim=1)


def digits2(x: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``encode2`` as the top (int32, ``NONFINITE`` for inf and NaN) and the two slots
    (int64), elementwise: for a caller that fuses more into the same loop."""
    bits = x.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    bad = biased == 0xFF
    m = (frac | torch.where(biased != 0, 0x800000, 0)).to(torch.int64)
    lead = biased.clamp(min=1) - 127          # floor(log2|x|); -126 for subnormals
    top = torch.div(lead + 126, W, rounding_mode="floor") + 1
    below = (top - 1) * W - 126 - (lead - 23)  # significand bits below the top bin
    right = below.clamp(min=0).to(torch.int64)
    left = (-below).clamp(min=0).to(torch.int64)
    q = m >> right
    rest = m - (q << right)
    half = torch.bitwise_left_shift(torch.ones_like(right), right) >> 1
    up = (rest > half) | ((rest == half) & (half > 0) & ((q & 1) == 1))  # half to even
    q = q + up.to(torch.int64)
    low = (m - (q << right)) << (W - right)
    high = q << left
    neg = bits < 0
    nan = bad & (frac != 0)
    b0 = torch.where(bad, ((~neg) | nan).to(torch.int64), torch.where(neg, -high, high))
    b1 = torch.where(bad, (neg | nan).to(torch.int64), torch.where(neg, -low, low))
    return torch.where(bad, NONFINITE, torch.where(m != 0, top, 0)), b0, b1


def _shift2(bins: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Slot k of the result is slot k - shift of ``bins`` (0 below slot 0). Written over
    the [n, 2] shape with broadcasting: inductor vectorizes that better than a stack of
    two columns."""
    slot = torch.arange(2, device=bins.device)[None, :]
    s = shift[:, None]
    return torch.where(s == 0, bins, torch.where((s == 1) & (slot == 1), bins[:, :1], 0))


def merge2(a_index: torch.Tensor, a_bins: torch.Tensor, b_index: torch.Tensor,
           b_bins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact sum of two K=2 binned forms: aligned to the MAX of their tops, added."""
    index = torch.maximum(a_index, b_index)
    shift_a = index.to(torch.int64) - a_index.to(torch.int64)
    shift_b = index.to(torch.int64) - b_index.to(torch.int64)
    return index, _shift2(a_bins, shift_a) + _shift2(b_bins, shift_b)


def align2(index: torch.Tensor, bins: torch.Tensor,
           to: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K=2 bins moved to the tops ``to``, and whether any top was below its own."""
    shift = to.to(torch.int64) - index.to(torch.int64)
    return _shift2(bins, shift), (shift < 0).any()


def decode2(index: torch.Tensor, bins: torch.Tensor, W: int, base: int,
            overflow: float) -> tuple[torch.Tensor, ...]:
    """K=2 decoding (sums.decode's fast path, in one loop): the fp32 sums, and flags for
    a top sum beyond 53 bits (the caller then decodes eagerly), non-finite elements and
    fp32 overflow."""
    bad = index == NONFINITE
    top = torch.where(bad, 0, index.to(torch.int64))
    bottom = base + (top - 1) * W
    c = bins[:, 1] >> W
    lo_i = bins[:, 1] - (c << W)
    hi_i = bins[:, 0] + c
    big = hi_i.abs() >= 2**53
    unit = pow2(bottom)
    hi = hi_i.to(torch.float64) * (unit * float(2**W))
    lo = lo_i.to(torch.float64) * unit
    s = hi + lo
    back = s - hi
    err = (hi - (s - back)) + (lo - back)
    # Round to odd: an inexact sum whose last bit is even moves one ulp towards the error.
    # As integers (float64 bit patterns are monotonic in magnitude), not nextafter, which
    # inductor does not vectorize; s is never 0 here when err is not (TwoSum).
    bits = s.view(torch.int64)
    outward = torch.where((err > 0) == (s > 0), 1, -1)
    ro = (bits + torch.where((err != 0) & ((bits & 1) == 0), outward, 0)).view(torch.float64)
    over = ro.abs() >= overflow
    out = ro.to(torch.float32)
    out = torch.where(over, torch.copysign(torch.full_like(out, float("inf")), out), out)
    pos = bins[:, 0] > 0
    negc = bins[:, 1] > 0
    special = torch.where(pos == negc, torch.full_like(out, float("nan")),
                          torch.where(pos, float("inf"), float("-inf")).to(out.dtype))
    out = torch.where(bad, special, out)
    # One reduction for the three flags: each is another pass over the input otherwise.
    flags = (big.to(torch.int8) | (bad.to(torch.int8) << 1)
             | ((over & ~bad).to(torch.int8) << 2)).amax()
    return out, (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0


def probe(n_random: int = 1 << 16, seed: int = 0) -> torch.Tensor:
    """fp32 values of every kind: each exponent with significands 0, 1, all ones, and
    ties and near-ties at every split of the significand; both signs; inf, NaN; and
    random bit patterns (every exponent, NaN payloads included)."""
    exps = torch.arange(256, dtype=torch.int64)
    fracs = [0, 1, 0x7FFFFF, 0x400000]
    for u in range(1, 24):
        fracs += [1 << (u - 1), (1 << (u - 1)) | (1 << u), (1 << (u - 1)) + 1,
                  (1 << (u - 1)) - 1 if u > 1 else 0]
    frac = torch.tensor(fracs, dtype=torch.int64)
    grid = ((exps[:, None] << 23) | frac[None, :]).reshape(-1)
    grid = torch.cat([grid, grid | (1 << 31)])
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, 1 << 32, (n_random,), generator=g, dtype=torch.int64)
    words = torch.cat([grid, rand])
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as int32 bits
    return words.to(torch.int32).view(torch.float32)
