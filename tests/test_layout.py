"""The row-sharded layout and its copies, on one process (no communication)."""

import pytest
import torch

from shardwise.engine.groups.copies import (
    copy_out,
    padding_gaps,
    rank_major,
    round_chunks,
    round_span,
    scatter_rounds,
    write_rank_major,
)
from shardwise.engine.groups.layout import ALIGN, build_layout

SHAPES = [(10, 4), (1,), (3, 2, 5), (0, 7), (130,), (2, 3)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_follow_torch_chunk_and_pieces_tile_each_parameter(world):
    layout = build_layout(SHAPES, world)
    for i, shape in enumerate(SHAPES):
        t = torch.arange(torch.Size(shape).numel()).view(shape)
        chunks = torch.chunk(t, world) if shape[0] else ()
        covered = 0
        for rank in range(world):
            rows = layout.slots[i].local_rows(rank)
            expect = chunks[rank].shape[0] if rank < len(chunks) else 0
            assert rows == expect, (shape, rank)
            piece = layout.piece(i, rank)
            if piece.numel:
                assert piece.param_offset == covered  # contiguous flat ranges, in order
            covered += piece.numel
            assert piece.shard_offset % ALIGN == 0
        assert covered == t.numel()
    assert layout.shard_numel % ALIGN == 0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_major_write_then_copy_out_round_trips(world):
    layout = build_layout(SHAPES, world)
    values = [torch.randn(shape) for shape in SHAPES]
    buf = rank_major(layout, padding_gaps(layout), torch.float32, torch.device("cpu"))
    for slot, v in zip(layout.slots, values):
        write_rank_major(buf, layout, slot, v)
    for start, end in padding_gaps(layout):
        assert not buf[start:end].any()  # padding stays zero: reductions sum zeros there
    full = torch.empty(layout.full_numel)
    copy_out(buf, layout, full)
    for slot, v in zip(layout.slots, values):
        assert torch.equal(full[slot.full_offset:slot.full_offset + slot.numel].view(v.shape), v)
    # Each rank's shard holds exactly its torch.chunk rows.
    shards = buf.view(world, layout.shard_numel)
    for slot, v in zip(layout.slots, values):
        for rank, rows in enumerate(torch.chunk(v, world) if v.shape[0] else ()):
            got = shards[rank, slot.offset:slot.offset + rows.numel()].view(rows.shape)
            assert torch.equal(got, rows)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_copy_out_reads_its_own_rows_from_the_shard(world):
    """Note [own rows from the shard]: with ``own``, the gathered buffer's part for that
    rank is never read (NaN here) and the full buffer gets the same bits from the shard,
    for every rank, short chunks and empty ones included."""
    layout = build_layout(SHAPES, world)
    values = [torch.randn(shape) for shape in SHAPES]
    buf = rank_major(layout, padding_gaps(layout), torch.float32, torch.device("cpu"))
    for slot, v in zip(layout.slots, values):
        write_rank_major(buf, layout, slot, v)
    expect = torch.zeros(layout.full_numel)
    copy_out(buf, layout, expect)
    for rank in range(world):
        shards = buf.view(world, layout.shard_numel).clone()
        shard = shards[rank].clone()
        shards[rank] = float("nan")
        full = torch.zeros(layout.full_numel)
        copy_out(shards.view(-1), layout, full, own=(rank, shard))
        assert torch.equal(full, expect), rank


def test_zero_dim_shapes_are_refused():
    with pytest.raises(ValueError, match="0-dim"):
        build_layout([()], 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("limit", [1, 600, 1 << 20])
def test_scatter_rounds_send_what_one_rank_major_buffer_held(world, limit):
    """Note [scatter in rounds]: the rounds' chunks, put at their spans, are each rank's
    shard as one rank-major copy of the whole group gives it (padding aside, which the
    receiver zeroes), whatever the round size; every slot is in exactly one round."""
    layout = build_layout(SHAPES, world)
    values = [torch.randn(shape) for shape in SHAPES]
    whole = rank_major(layout, padding_gaps(layout), torch.float32, torch.device("cpu"))
    for slot, v in zip(layout.slots, values):
        write_rank_major(whole, layout, slot, v)
    want = whole.view(world, layout.shard_numel)
    got = torch.zeros(world, layout.shard_numel)
    rounds = scatter_rounds(layout, 4, limit)
    assert [i for r in rounds for i in r] == list(range(len(SHAPES)))
    for slots in rounds:
        lo, hi = round_span(layout, slots)
        chunks = round_chunks(layout, slots, values, torch.float32, torch.device("cpu"))
        assert len(chunks) == world and all(c.numel() == hi - lo for c in chunks)
        for rank, c in enumerate(chunks):
            got[rank, lo:hi] = c
    assert torch.equal(got, want)


def test_a_large_parameter_is_sent_from_its_own_rows():
    """A round of one parameter is sent from views of its rows: only a short last chunk
    is copied (padded), and every chunk of a value that must be cast."""
    layout = build_layout([(8, 1024), (7, 1024)], 4)
    even, uneven = torch.randn(8, 1024), torch.randn(7, 1024)
    rounds = scatter_rounds(layout, 4, limit=1024)
    assert rounds == [range(0, 1), range(1, 2)]
    cpu = torch.device("cpu")

    def views(chunks, value):
        return [c.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
                for c in chunks]

    assert views(round_chunks(layout, rounds[0], [even, uneven], torch.float32, cpu),
                 even) == [True] * 4
    # 7 rows over 4 ranks: 2, 2, 2 and 1 (padded to 2).
    assert views(round_chunks(layout, rounds[1], [even, uneven], torch.float32, cpu),
                 uneven) == [True, True, True, False]
    assert views(round_chunks(layout, rounds[0], [even, uneven], torch.float64, cpu),
                 even) == [False] * 4
