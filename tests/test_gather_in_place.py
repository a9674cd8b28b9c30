"""Gathering in place (Note [gathering in place] in engine/groups/flat.py): a unit of one
parameter whose chunk of rows fills whole alignment blocks is gathered straight into its
full buffer's memory, with no second, rank-major copy; every other group is copied out.

The same training runs twice on the same ranks, gathering in place and with the copy
forced back, and must give the same bits: what the all-gather writes is the same bytes
in the same order either way.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import run_ranks

import shardwise as sw
from shardwise.engine.iteration.state import model_state

VOCAB, SEQ, WIDTH = 96, 16, 32


class Net(nn.Module):
    """Units of one parameter each: ``tok`` (96 rows of 32, split evenly over 2 and 3
    ranks); ``pos`` (16 rows, split 6, 6, 4 over 3 ranks: the full buffer is padded to
    18 rows as the shards are, so the orders are still one); ``head`` (96 rows) — each
    rank's chunk a whole number of 64-element alignment blocks. ``odd`` (10 rows of 24:
    chunks of 120 and 96 elements, each padded to 128 in its shard) and the ``mix`` block
    (two parameters) are copied out."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.odd = nn.Embedding(10, 24)
        self.mix = nn.Linear(WIDTH + 24, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        h = torch.tanh(self.mix(torch.cat([h, self.odd(x % 10)], dim=-1)))
        return F.cross_entropy(self.head(h).flatten(0, 1), x.flatten())


IN_PLACE = {"tok", "pos", "head"}


def _train(rank, world, in_place, options):
    torch.manual_seed(0)
    model = sw.shard(Net(), units=lambda name, mod: name in {"tok", "pos", "odd", "mix",
                                                             "head"}, **options)
    groups = {u.name: g for u in model_state(model).units for g in u.groups}
    flags = {name: g.gathers_in_place for name, g in groups.items()}
    if not in_place:
        for g in groups.values():
            g.gathers_in_place = False
    # An issued gather of an in-place group writes into the full buffer's storage.
    into_full = {}
    for name, g in groups.items():
        g.start_gather()
        into_full[name] = g._gathered_into_full()
        g.wait_gather(fill=False)
        g.free()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x = torch.randint(0, VOCAB, (2, SEQ),
                          generator=torch.Generator().manual_seed(rank + 10 * step))
        loss = model(x)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return flags, into_full, losses, sw.full_state_dict(model)


@pytest.mark.parametrize("options", [
    {},
    {"prefetch": 2},
    {"mixed_precision": sw.MixedPrecision(param_dtype=torch.bfloat16)},
], ids=["default", "prefetch2", "bf16"])
@pytest.mark.parametrize("world", [2, 3])
def test_gathering_in_place_gives_the_copys_bits(world, options):
    ours = run_ranks(_train, world, True, options)
    copied = run_ranks(_train, world, False, options)
    flags, into_full = ours[0][0], ours[0][1]
    assert {n for n, f in flags.items() if f} == IN_PLACE, flags
    assert {n for n, f in into_full.items() if f} == IN_PLACE, into_full
    assert not any(copied[0][1].values()), copied[0][1]
    for r in range(world):
        assert ours[r][2] == copied[r][2], (r, ours[r][2], copied[r][2])
    for name, value in copied[0][3].items():
        assert torch.equal(ours[0][3][name], value), name


class _Raising(nn.Module):
    """Four units of one 64 x 64 weight each (gathered in place), whose forward rank 1
    leaves at the second when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            if fail and i == 1:
                raise ValueError("a bad batch")
            x = b(x)
        return x


def _diverged(rank, world):
    """Ranks diverge with in-place gathers in flight (prefetch 2): a gather left to gloo
    is never waited for, and the full buffer it writes into must not be freed under it
    (Note [gathering in place]). Observed around the group's own steps: the works of a
    gather not completed when it was settled, and the storage the gather wrote into."""
    from shardwise.engine.groups.flat import FlatGroup

    freed_in_flight = []
    wait_gather, free = FlatGroup.wait_gather, FlatGroup.free

    def watched_wait(g, fill=True, keep=False):
        work, target = g._gather_work, g._gathered
        works = list(work._works) if work is not None else []
        wait_gather(g, fill, keep)
        pending = [w for w in works if not w.is_completed()]
        if pending and target is not None:
            g._left_to_gloo = (target.untyped_storage()._cdata, pending)

    def watched_free(g, keep_grads=False):
        left = g.__dict__.pop("_left_to_gloo", None)
        if left is not None and any(not w.is_completed() for w in left[1]) and \
                g.full.untyped_storage()._cdata == left[0]:
            freed_in_flight.append(g.unit_name)
        free(g, keep_grads)

    FlatGroup.wait_gather, FlatGroup.free = watched_wait, watched_free
    try:
        torch.manual_seed(0)
        model = sw.shard(_Raising(), prefetch=2)
        assert all(g.gathers_in_place for u in model_state(model).units[1:]
                   for g in u.groups)
        x = torch.ones(2, 64)
        expect = model(x)
        expect.sum().backward()
        if rank == 1:
            with pytest.raises(ValueError):
                model(x, fail=True)
        with pytest.raises(sw.ShardwiseError, match="diverged"):
            model(x).sum().backward()
        with torch.no_grad():  # training goes on, from the same shards
            assert torch.equal(model(x), expect.detach())
        return freed_in_flight
    finally:
        FlatGroup.wait_gather, FlatGroup.free = wait_gather, free


def test_a_gather_left_to_gloo_keeps_its_buffer():
    assert run_ranks(_diverged, 2, timeout=120) == [[], []]
