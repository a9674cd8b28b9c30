"""Pure arithmetic: where each parameter lives in a unit's padded flat buffer.

No torch.distributed here, so the layout can be tested on its own.

Note [alignment]
Every parameter starts at a multiple of ``ALIGN`` elements and every rank's shard is a
multiple of ``ALIGN`` elements long. Elementwise CPU kernels (the optimizer's) run a
vectorised body over chunks counted from a tensor's first element and a scalar loop over
the tail, and the two can round differently (fused multiply-add in one, not the other).
With aligned cut points, each element of a shard is processed by the same code path as
the same element of the unsharded parameter, so a sharded AdamW step is bit-identical to
an unsharded one. 64 elements covers two AVX-512 vectors of 2-byte dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class Span:
    """One parameter's place in the flat (unsharded, padded) buffer."""

    offset: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank stores.

    ``shard_offset`` is where it starts in the rank's shard, ``param_offset`` where it
    starts in the flattened parameter; ``numel`` may be 0.
    """

    shard_offset: int
    param_offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Padded flat layout of a list of parameters over ``world_size`` ranks."""

    spans: tuple[Span, ...]
    world_size: int
    shard_numel: int

    @property
    def total_numel(self) -> int:
        """Elements in the full padded buffer (``world_size * shard_numel``)."""
        return self.world_size * self.shard_numel

    def piece(self, index: int, rank: int) -> Piece:
        """The part of parameter ``index`` stored on ``rank``."""
        span = self.spans[index]
        lo = rank * self.shard_numel
        hi = lo + self.shard_numel
        start = max(span.offset, lo)
        end = min(span.offset + span.numel, hi)
        if end <= start:
            return Piece(shard_offset=0, param_offset=0, numel=0)
        return Piece(shard_offset=start - lo, param_offset=start - span.offset, numel=end - start)

    def pieces(self, rank: int) -> list[Piece]:
        """``piece(i, rank)`` for every parameter."""
        return [self.piece(i, rank) for i in range(len(self.spans))]


def build_layout(numels: list[int], world_size: int, align: int = ALIGN) -> FlatLayout:
    """Lay ``numels`` out back to back, each aligned, and split into equal shards.

    Raises:
        ValueError: for a world size below 1 or a negative numel.

    Example:
        >>> build_layout([10, 100], 3).shard_numel
        64
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    spans = []
    cursor = 0
    for n in numels:
        if n < 0:
            raise ValueError(f"numel must be non-negative, got {n}")
        spans.append(Span(offset=cursor, numel=n))
        cursor = _round_up(cursor + n, align)
    # At least one aligned block per rank: zero-sized collectives are not portable.
    shard = max(_round_up(-(-cursor // world_size), align), align)
    return FlatLayout(spans=tuple(spans), world_size=world_size, shard_numel=shard)
