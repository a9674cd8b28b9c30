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
    whole, n, rest = slot.regions
    if not n:
        return []
    grid = buf.view(layout.world_size, layout.shard_numel)
    offset = slot.offset
    out = [(grid[:whole, offset:offset + slot.chunk_numel], slice(0, n))]
    if rest:
        out.append((grid[whole, offset:offset + rest], slice(n, n + rest)))
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


# Note [own rows from the shard]
# An all-gather by exchange (Note [gloo exchanges] in comm/collectives.py) receives each
# peer's shard into its part of the rank-major output; this rank's part was a copy of
# its own shard, made only to be copied out again into the full buffer. A gather whose
# output nothing keeps (no secondary shard, Note [secondary shards] in comm/mesh.py) and
# is copied out (not gathered in place, Note [gathering in place] in
# engine/groups/flat.py) skips that copy (``Comm.all_gather(skip_own=True)``) and
# copies its own rows into the full buffer straight from the shard it sent (unchanged
# until the exchange is waited for, as any sent tensor): one shard's copy less per
# gather, which on the small Llama is half a megabyte to 8 MB per gather (issue 54). The
# values are the same bits.
def copy_out(gathered: torch.Tensor, layout: ShardLayout, out: torch.Tensor,
             own: tuple[int, torch.Tensor] | None = None) -> None:
    """Copy a rank-major all-gather output into a parameter-major full buffer. ``own``:
    ``(rank, shard)``, that rank's part of ``gathered`` was not written and its rows are
    read from ``shard`` instead (Note [own rows from the shard])."""
    grid = gathered.view(layout.world_size, layout.shard_numel)
    with torch.no_grad():
        # row_regions for every slot, from the layout's plan (Note [layouts are read
        # per call] in engine/groups/layout.py).
        if own is None:
            for at, offset, chunk, whole, n, rest in layout.copy_plan:
                out[at:at + n].view(whole, chunk).copy_(grid[:whole, offset:offset + chunk])
                if rest:
                    out[at + n:at + n + rest].copy_(grid[whole, offset:offset + rest])
            return
        rank, shard = own
        for at, offset, chunk, whole, n, rest in layout.copy_plan:
            if rank < whole:  # a whole chunk of its rows: the ranks before, it, those after
                mine = at + rank * chunk
                if rank:
                    out[at:mine].view(rank, chunk).copy_(grid[:rank, offset:offset + chunk])
                out[mine:mine + chunk].copy_(shard[offset:offset + chunk])
                if rank + 1 < whole:
                    out[mine + chunk:at + n].view(whole - rank - 1, chunk).copy_(
                        grid[rank + 1:whole, offset:offset + chunk])
                if rest:
                    out[at + n:at + n + rest].copy_(grid[whole, offset:offset + rest])
                continue
            out[at:at + n].view(whole, chunk).copy_(grid[:whole, offset:offset + chunk])
            if rest:  # the short chunk: this rank's own, or a peer's
                source = shard if rank == whole else grid[whole]
                out[at + n:at + n + rest].copy_(source[offset:offset + rest])


# Note [scatter in rounds]
# ``sw.shard`` sends each rank its rows from ``src_rank``'s full values. A rank-major copy
# of a whole group on ``src_rank`` before one scatter would hold a second copy of the
# group there (the root unit of a Llama holds the embeddings and the head: 1.3 GB in fp32
# at 13B width). The group goes instead in rounds of consecutive parameters, each a
# contiguous range of every rank's shard, each rank-major copy at most ``ROUND_BYTES``; a
# parameter larger than that is a round of its own, sent from views of its own rows: only
# a rank's short chunk is copied (padded), and every chunk when the value must first be
# cast or moved to the group's dtype and device.
ROUND_BYTES = 32 << 20


def scatter_rounds(layout: ShardLayout, element_size: int,
                   limit: int = ROUND_BYTES) -> list[range]:
    """The group's slots in rounds (Note [scatter in rounds]): consecutive slot indices
    whose rank-major bytes stay within ``limit``, or one slot alone."""
    rounds: list[range] = []
    start = size = 0
    for i, s in enumerate(layout.slots):
        n = s.chunk_numel * layout.world_size * element_size
        if i > start and size + n > limit:
            rounds.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(layout.slots):
        rounds.append(range(start, len(layout.slots)))
    return rounds


def round_span(layout: ShardLayout, slots: range) -> tuple[int, int]:
    """The range ``[lo, hi)`` of every rank's shard that a round's slots take."""
    first, last = layout.slots[slots[0]], layout.slots[slots[-1]]
    return first.offset, last.offset + last.chunk_numel


def round_chunks(layout: ShardLayout, slots: range, values: list[torch.Tensor],
                 dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Each rank's part of a round (its :func:`round_span` of the shard), rank by rank,
    from the parameters' full ``values``: for a round of one parameter, its rows chunk by
    chunk (views where nothing is padded, cast or moved), else a rank-major copy of the
    round."""
    lo, hi = round_span(layout, slots)
    world = layout.world_size
    if len(slots) == 1 and layout.slots[slots[0]].numel > 0:
        s, flat = layout.slots[slots[0]], values[slots[0]].detach().reshape(-1)
        chunks = []
        for r in range(world):
            a = min(r * s.chunk_numel, s.numel)
            piece = flat[a:a + s.chunk_numel].to(device, dtype)
            if piece.numel() < s.chunk_numel:  # a short (or empty) last chunk: padded
                piece = torch.cat([piece, piece.new_zeros(s.chunk_numel - piece.numel())])
            chunks.append(piece)
        return chunks
    grid = torch.zeros(world, hi - lo, dtype=dtype, device=device)
    for i in slots:
        s = layout.slots[i]
        if s.numel == 0:
            continue
        flat = values[i].detach().reshape(-1).to(device, dtype)
        at = s.offset - lo
        whole = s.rows // s.chunk_rows
        n = whole * s.chunk_numel
        grid[:whole, at:at + s.chunk_numel].copy_(flat[:n].view(whole, s.chunk_numel))
        if n < s.numel:
            grid[whole, at:at + s.numel - n].copy_(flat[n:])
    return list(grid.unbind(0))
