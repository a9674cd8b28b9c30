"""Copies between parameter-major and rank-major buffers (Note [row sharding]).

A gather's all-gather output holds every rank's shard one after the other (rank-major);
the full parameters need each parameter's rows together (parameter-major). A reduction
goes the other way: full gradients are written rank-major, so that one reduce-scatter
leaves each rank its rows. Each parameter moves with at most two strided copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layout import ShardLayout, Slot


def row_regions(buf: torch.Tensor, layout: ShardLayout, slot: Slot,
                 ) -> list[tuple[torch.Tensor, slice]]:
    """Where a parameter's flattened elements sit in a rank-major buffer.

    Returns ``(view of buf, slice of the flattened parameter)`` pairs: one block for the
    ranks holding ``chunk_rows`` rows, one row for a rank holding fewer, if any.
    """
    if slot.numel == 0:
        return []
    grid = buf.view(layout.world_size, layout.shard_numel)
    whole = slot.rows // slot.chunk_rows
    n = whole * slot.chunk_numel
    out = [(grid[:whole, slot.offset:slot.offset + slot.chunk_numel], slice(0, n))]
    if n < slot.numel:
        out.append((grid[whole, slot.offset:slot.offset + slot.numel - n],
                    slice(n, slot.numel)))
    return out


def rank_major(layout: ShardLayout, gaps: list[tuple[int, int]], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A new rank-major buffer whose padding (``gaps``) is zero."""
    buf = torch.empty(layout.gathered_numel, dtype=dtype, device=device)
    for start, end in gaps:
        buf[start:end].zero_()
    return buf


def padding_gaps(layout: ShardLayout) -> list[tuple[int, int]]:
    """Every range of a rank-major buffer that holds no parameter element."""
    n = layout.shard_numel
    return [(r * n + a, r * n + b) for r in range(layout.world_size)
            for a, b in layout.padding(r)]


def write_rank_major(buf: torch.Tensor, layout: ShardLayout, slot: Slot,
                     value: torch.Tensor,
                     op: Callable[[torch.Tensor, torch.Tensor], object] | None = None) -> None:
    """Write a parameter's full ``value`` into its rows of rank-major ``buf``
    (``op(dst, src)`` instead of a copy when given)."""
    flat = value.detach().reshape(-1)
    for dst, sl in row_regions(buf, layout, slot):
        src = flat[sl].view(dst.shape)
        if op is None:
            dst.copy_(src)
        else:
            op(dst, src)


def copy_out(gathered: torch.Tensor, layout: ShardLayout, out: torch.Tensor) -> None:
    """Copy a rank-major all-gather output into a parameter-major full buffer."""
    with torch.no_grad():
        for s in layout.slots:
            flat = out[s.full_offset:s.full_offset + s.numel]
            for region, sl in row_regions(gathered, layout, s):
                flat[sl].view(region.shape).copy_(region)
