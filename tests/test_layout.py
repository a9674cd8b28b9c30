"""The row-sharded layout and its copies, on one process (no communication)."""

import pytest
import torch

from shardwise.engine.groups.copies import copy_out, padding_gaps, rank_major, write_rank_major
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


def test_zero_dim_shapes_are_refused():
    with pytest.raises(ValueError, match="0-dim"):
        build_layout([()], 2)
