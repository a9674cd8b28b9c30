"""Pure arithmetic: where each parameter's rows live in a unit's buffers.

No torch.distributed here, so the layout can be tested on its own.

Note [row sharding]
Every parameter is sharded on dim 0 the way ``torch.chunk`` (and so ``DTensor``'s
``Shard(0)``) splits it: with ``c = ceil(rows / N)``, rank r holds rows
``[r*c, min((r+1)*c, rows))``, possibly none. A 1-D parameter's rows are its elements.
Each rank's *shard* of a group is one flat buffer holding, for every parameter in order,
a slot of ``c * row_numel`` elements (the rank's rows, zero-padded to ``c`` rows), each
slot starting at a multiple of ``ALIGN``. All ranks' shards have the same size, so one
all-gather of the shards gives a rank-major buffer; the *full* buffer holds every
parameter contiguously (``N * c`` rows, of which the first ``rows`` are the parameter),
so copying out is one strided copy per parameter. Rank r's rows are also the contiguous
flat range ``[r*c*row_numel, ...)`` of the flattened parameter, which is what checkpoints
record (``Piece``).

Note [alignment]
Every slot starts at a multiple of ``ALIGN`` elements, in the shard and in the full
buffer. Elementwise CPU kernels run a vectorised body from a tensor's first element and a
scalar loop over the tail, and aligned starts keep each element of a shard on the same
code path whatever the neighbouring parameters are. 64 elements covers two AVX-512
vectors of 2-byte dtypes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

ALIGN = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


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
class Slot:
    """One parameter's place in every rank's shard and in the full buffer."""

    shape: tuple[int, ...]
    rows: int          # size of dim 0 (the element count for a 1-D parameter)
    row_numel: int     # elements per row
    chunk_rows: int    # rows per rank, ``ceil(rows / world_size)``
    offset: int        # start of the slot in each rank's shard
    full_offset: int   # start of the parameter in the full buffer

    # Note [layouts are read per call]
    # A slot's and a layout's derived figures are read by every gather's copy-out and
    # every reduction's copy-in, parameter by parameter, each micro-batch (issue 54: a
    # fixed cost per parameter): they are computed once, at the first read, and kept
    # (the records are frozen, so they never change).
    @functools.cached_property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @functools.cached_property
    def chunk_numel(self) -> int:
        """Elements of one rank's slot (padded rows included)."""
        return self.chunk_rows * self.row_numel

    @functools.cached_property
    def regions(self) -> tuple[int, int, int]:
        """Where its elements sit in a rank-major buffer (``copies.row_regions``):
        ``(whole, n, rest)``: the first ``whole`` ranks hold ``chunk_numel`` elements
        each, ``n`` in all, the next one the ``rest`` (0: none)."""
        whole = self.rows // self.chunk_rows if self.chunk_rows else 0
        n = whole * self.chunk_numel
        return whole, n, self.numel - n

    def local_rows(self, rank: int) -> int:
        """How many rows ``rank`` holds (``torch.chunk`` semantics; possibly 0)."""
        return max(0, min(self.chunk_rows, self.rows - rank * self.chunk_rows))


@dataclass(frozen=True)
class ShardLayout:
    """Row-sharded layout of a list of parameters over ``world_size`` ranks."""

    slots: tuple[Slot, ...]
    world_size: int
    shard_numel: int   # elements of each rank's shard
    full_numel: int    # elements of the full buffer

    @property
    def gathered_numel(self) -> int:
        """Elements of the all-gather output (every rank's shard, rank after rank)."""
        return self.world_size * self.shard_numel

    @functools.cached_property
    def copy_plan(self) -> tuple[tuple[int, int, int, int, int, int], ...]:
        """Every non-empty slot's ``(full_offset, offset, chunk_numel, whole, n, rest)``
        (``Slot.regions``), for ``copies.copy_out`` (Note [layouts are read per call])."""
        return tuple((s.full_offset, s.offset, s.chunk_numel, *s.regions)
                     for s in self.slots if s.numel)

    def piece(self, index: int, rank: int) -> Piece:
        """The part of parameter ``index`` stored on ``rank``."""
        s = self.slots[index]
        n = s.local_rows(rank) * s.row_numel
        start = rank * s.chunk_numel if n else 0
        return Piece(shard_offset=s.offset, param_offset=start, numel=n)

    def padding(self, rank: int) -> list[tuple[int, int]]:
        """Ranges of ``rank``'s shard that hold no parameter element."""
        gaps, cursor = [], 0
        for i, s in enumerate(self.slots):
            used = self.piece(i, rank).numel
            if s.offset > cursor:
                gaps.append((cursor, s.offset))
            cursor = s.offset + used
        if cursor < self.shard_numel:
            gaps.append((cursor, self.shard_numel))
        return gaps


def build_layout(shapes: list[tuple[int, ...]], world_size: int,
                 align: int = ALIGN) -> ShardLayout:
    """Lay out parameters of ``shapes`` for row sharding over ``world_size`` ranks.

    Raises:
        ValueError: for a world size below 1, a 0-dim shape or a negative size.

    Example:
        >>> build_layout([(10, 4), (100,)], 3).shard_numel   # 4 rows * 4, then 34
        128
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    slots = []
    shard_cursor = full_cursor = 0
    for shape in shapes:
        if len(shape) == 0:
            raise ValueError("0-dim parameters cannot be sharded on dim 0")
        if any(d < 0 for d in shape):
            raise ValueError(f"negative size in shape {shape}")
        rows, row_numel = shape[0], math.prod(shape[1:])
        chunk = -(-rows // world_size)
        slots.append(Slot(tuple(shape), rows, row_numel, chunk, shard_cursor, full_cursor))
        shard_cursor = _round_up(shard_cursor + chunk * row_numel, align)
        full_cursor = _round_up(full_cursor + world_size * chunk * row_numel, align)
    # At least one aligned block: zero-sized collectives are not portable.
    shard = max(shard_cursor, align)
    return ShardLayout(slots=tuple(slots), world_size=world_size, shard_numel=shard,
                       full_numel=max(full_cursor, align))


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``DTensor`` and FSDP2's
    protocol are told a full parameter has)."""
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
