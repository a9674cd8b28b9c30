"""Bytes each rank sends per training step: the ZeRO-3 theory, up to padding.

Per step every unit is all-gathered for its forward and, unless it stays gathered, once
more for its backward. Two units stay gathered: the root, which runs first and is needed
again right at the start of backward, and the unit that ran last in forward, whose
backward comes first. Every trainable unit's gradients are reduce-scattered once.
``sw.inspect(model).comm`` counts each collective's input on this rank (a shard for an
all-gather, the full (padded) gradient buffer for a reduce-scatter) and the bytes gloo's
exchanges send. The exchanges themselves are tested in test_comm.py.
"""

import pytest
import torch
from harness import run_ranks

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=2, d_model=32)


def _volume(rank, world, reshard_after_forward):
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG), reshard_after_forward=reshard_after_forward)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    model(x, x).backward()  # the first step records the order prefetching follows
    before = sw.inspect(model).comm
    model(x, x).backward()
    view = sw.inspect(model)
    stats = view.comm.since(before)
    param_bytes = expect_ag = expect_rs = padding = 0
    last = view.unit(f"blocks.{CFG.n_layer - 1}")  # runs last in forward, first in backward
    for u in view.units:
        once = u.is_root or u is last or not reshard_after_forward
        gathers = 1 if once else 2
        for g in u.groups:
            size = g.dtype.itemsize
            params = sum(p.numel for p in g.params)
            param_bytes += params * size
            padding += (g.gathered_numel - params) * size
            # At most one aligned block per parameter and rank, plus the tail.
            assert g.gathered_numel - params <= world * view.align * (len(g.params) + 1)
            expect_ag += gathers * g.shard_numel * size
            expect_rs += g.gathered_numel * size if g.requires_grad else 0
    assert stats.bytes["all_gather"] == expect_ag, (stats.bytes, expect_ag)
    assert stats.bytes["reduce_scatter"] == expect_rs, (stats.bytes, expect_rs)
    # Against the theory on unpadded parameter bytes: all-gathers send 1/N of each
    # unit's bytes twice (once for the root and for the unit whose backward comes first,
    # which stay gathered), the reduce-scatter the unit's bytes once.
    kept = sum(p.numel * g.dtype.itemsize
               for u in (view.units[0], last) for g in u.groups for p in g.params)
    theory_ag = ((2 if reshard_after_forward else 1) * param_bytes
                 - (kept if reshard_after_forward else 0)) / world
    assert theory_ag <= expect_ag <= theory_ag + 2 * padding / world
    assert param_bytes <= expect_rs <= param_bytes + padding
    # On the wire (gloo's exchanges count what they send): every all-gather sends this
    # rank's shard to N-1 peers, every reduce-scatter N-1 of its input's N chunks, which
    # is the ring algorithm's (N-1)/N of a unit per pass.
    assert stats.sent["all_gather"] == (world - 1) * expect_ag, (stats.sent, expect_ag)
    assert stats.sent["reduce_scatter"] * world == (world - 1) * expect_rs, stats.sent
    return stats.bytes["all_gather"], stats.bytes["reduce_scatter"], param_bytes


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_step_match_zero3_theory(world, reshard_after_forward):
    ag, rs, params = run_ranks(_volume, world, reshard_after_forward)[0]
    print(f"N={world} reshard={reshard_after_forward}: all-gather {ag / params:.3f}x, "
          f"reduce-scatter {rs / params:.3f}x the parameter bytes")


def _prefetch_depths(rank, world):
    out = {}
    for depth in (0, 1, 3):
        torch.manual_seed(0)
        model = sw.shard(GPT(CFG), prefetch=depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = sw.inspect(model).comm
        seen: list[list[str]] = []  # unit states when blocks.0 starts computing
        model.blocks[0].register_forward_pre_hook(
            lambda *_: seen.append([u.state for u in sw.inspect(model).units]))
        losses = []
        for step in range(3):
            x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len),
                              generator=torch.Generator().manual_seed(rank + step))
            loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        ahead = [s == "gathering" for s in seen[-1][2:]]  # blocks.1, blocks.2
        assert ahead == [depth >= 1, depth >= 2], (depth, seen[-1])
        stats = sw.inspect(model).comm.since(before)
        out[depth] = (losses, stats.bytes["all_gather"], stats.calls["all_gather"])
    with pytest.raises(sw.ShardwiseError, match="prefetch"):
        sw.shard(GPT(CFG), prefetch=-1)
    return out


def test_prefetch_depth_changes_when_units_are_gathered_not_what_or_how_often():
    out = run_ranks(_prefetch_depths, 3)[0]
    assert out[0] == out[1] == out[3], out  # same losses, same bytes, same calls


class _LastFrozen(torch.nn.Module):
    """Two trainable blocks, then a frozen one that runs last on an input without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.blocks[2].requires_grad_(False)

    def forward(self, x):
        h = self.blocks[1](self.blocks[0](x))
        return h + self.blocks[2](torch.ones_like(x))


def _last_unit_kept(rank, world):
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    last = f"blocks.{CFG.n_layer - 1}"
    for step in range(2):
        loss = model(x, x)
        # From the second step on, the order is known: the last block's backward comes
        # first, so it stays gathered; the others are freed.
        view = sw.inspect(model)
        assert view.unit(last).state == ("gathered" if step else "sharded")
        assert view.unit("blocks.0").state == "sharded"
        loss.backward()
        # Released with everything at backward's end.
        assert sw.inspect(model).unit(last).state == "sharded"
    frozen = sw.shard(_LastFrozen(), units=lambda name, m: name.startswith("blocks."))
    for _ in range(2):
        out = frozen(torch.randn(2, 8)).sum()
        # Its output needs no gradient, so no backward will gather it: freed at once.
        assert sw.inspect(frozen).unit("blocks.2").state == "sharded"
        out.backward()


def test_the_last_unit_stays_gathered_for_its_backward_unless_it_has_none():
    run_ranks(_last_unit_kept, 2)
