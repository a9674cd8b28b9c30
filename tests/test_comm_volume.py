"""Bytes each rank sends per training step: the ZeRO-3 theory, up to padding.

Per step every unit is all-gathered for its forward and, unless it stays gathered, once
more for its backward. Two units stay gathered: the root, which runs first and is needed
again right at the start of backward, and the unit that ran last in forward, whose
backward comes first. Every trainable unit's gradients are reduce-scattered once.
``CommStats`` counts each collective's input on this rank (a shard for an all-gather, the
full (padded) gradient buffer for a reduce-scatter) and the bytes gloo's exchanges send.
"""

import pytest
import torch
from harness import run_ranks

import shardwise as sw
from shardwise._layout import ALIGN
from shardwise._registry import model_state, unit_of
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=2, d_model=32)


def _volume(rank, world, reshard_after_forward):
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG), reshard_after_forward=reshard_after_forward)
    state = model_state(model)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    model(x, x).backward()  # the first step records the order prefetching follows
    stats = state.comm.stats
    stats.clear()
    model(x, x).backward()
    param_bytes = expect_ag = expect_rs = padding = 0
    last = unit_of(model.blocks[-1])  # runs last in forward, first in backward
    for u in state.units:
        once = u.is_root or u is last or not reshard_after_forward
        gathers = 1 if once else 2
        for g in u.groups:
            size = g.local.element_size()
            params = sum(p.numel for p in g.params)
            param_bytes += params * size
            padding += (g.layout.gathered_numel - params) * size
            # At most one aligned block per parameter and rank, plus the tail.
            assert g.layout.gathered_numel - params <= world * ALIGN * (len(g.params) + 1)
            expect_ag += gathers * g.layout.shard_numel * size
            expect_rs += g.layout.gathered_numel * size if g.requires_grad else 0
    assert stats.bytes["all_gather"] == expect_ag, (stats.bytes, expect_ag)
    assert stats.bytes["reduce_scatter"] == expect_rs, (stats.bytes, expect_rs)
    # Against the theory on unpadded parameter bytes: all-gathers send 1/N of each
    # unit's bytes twice (once for the root and for the unit whose backward comes first,
    # which stay gathered), the reduce-scatter the unit's bytes once.
    kept = sum(p.numel * g.local.element_size()
               for u in (state.units[0], last) for g in u.groups for p in g.params)
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
        state = model_state(model)
        stats = state.comm.stats
        seen: list[list[str]] = []  # unit states when blocks.0 starts computing
        model.blocks[0].register_forward_pre_hook(
            lambda *_: seen.append([u.state.value for u in state.units]))
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
        out[depth] = (losses, stats.bytes["all_gather"], stats.calls["all_gather"])
    with pytest.raises(sw.ShardwiseError, match="prefetch"):
        sw.shard(GPT(CFG), prefetch=-1)
    return out


def test_prefetch_depth_changes_when_units_are_gathered_not_what_or_how_often():
    out = run_ranks(_prefetch_depths, 3)[0]
    assert out[0] == out[1] == out[3], out  # same losses, same bytes, same calls


def _exchanges_match_gloos_collectives(rank, world):
    import torch.distributed as dist

    from shardwise._comm import Comm

    comm = Comm(None)
    a, b = Comm(None), Comm(None)  # two models over one group, exchanging at once
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(world * 1000, generator=g) for _ in range(3)]
    everyone = torch.empty(world * world * 1000)
    dist.all_gather_into_tensor(everyone, inputs[0].clone())
    # Issued together, waited for in reverse: tags keep each exchange's messages apart.
    outs = [torch.empty(1000) for _ in inputs]
    works = [comm.reduce_scatter(outs[0], inputs[0], async_op=True),
             a.reduce_scatter(outs[1], inputs[1], async_op=True),
             b.reduce_scatter(outs[2], inputs[2], async_op=True)]
    for w in reversed(works):
        w.wait()
    for out, inp in zip(outs, inputs):
        expect = torch.empty(1000)
        dist.reduce_scatter_tensor(expect, inp.clone())  # torch's own (gloo: an all-reduce)
        if world <= 2:
            assert torch.equal(out, expect)  # one addition (or none): gloo's bits exactly
        else:
            # Another order of three additions: each sum may differ by one rounding of
            # each partial sum; |partials| < 16 for three standard normals here, where
            # fp32's spacing is at most 9.5e-7, so two roundings stay under 4e-6.
            torch.testing.assert_close(out, expect, rtol=0, atol=4e-6)
    rank_order = everyone.view(world, world, 1000)[:, rank].clone()
    total = rank_order[0].clone()
    for r in range(1, world):
        total.add_(rank_order[r])
    assert torch.equal(outs[0], total)  # the sum in rank order, the same on every run
    shard = torch.randn(777, generator=g)
    gathered, expect = torch.empty(world * 777), torch.empty(world * 777)
    pending = [comm.all_gather(gathered, shard, async_op=True),
               a.all_gather(torch.empty(world * 5), torch.ones(5), async_op=True)]
    for w in reversed(pending):
        w.wait()
    dist.all_gather_into_tensor(expect, shard)
    assert torch.equal(gathered, expect)
    comm.reduce_scatter(torch.empty(1000), torch.randn(world * 1000, generator=g))  # sync
    assert comm.stats.calls["reduce_scatter"] == 2
    assert comm.stats.calls["all_gather"] == 1
    if world == 3:  # a sub-group whose ranks are not the world's: peers are mapped
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            sub_comm = Comm(sub)
            inp = torch.randn(2 * 500, generator=g)
            out, expect = torch.empty(500), torch.empty(500)
            sub_comm.reduce_scatter(out, inp)
            dist.reduce_scatter_tensor(expect, inp.clone(), group=sub)
            assert torch.equal(out, expect)
            gathered, expect = torch.empty(2 * 500), torch.empty(2 * 500)
            sub_comm.all_gather(gathered, inp[:500])
            dist.all_gather_into_tensor(expect, inp[:500], group=sub)
            assert torch.equal(gathered, expect)


def _interrupted_wait(rank, world):
    import datetime

    import torch.distributed as dist

    from shardwise._comm import Comm

    comm = Comm(dist.new_group(timeout=datetime.timedelta(seconds=3)))
    shard = torch.full((100,), float(rank))
    out = torch.empty(world * 100)
    pending = comm.all_gather(out, shard, async_op=True)

    class Interrupted:  # Ctrl-C arriving right after the first work finished
        def __init__(self, work):
            self.work = work

        def wait(self):
            self.work.wait()
            raise KeyboardInterrupt

        def is_completed(self):
            return self.work.is_completed()

    pending._works[0] = Interrupted(pending._works[0])
    with pytest.raises(KeyboardInterrupt):
        pending.wait()
    pending.wait()  # resumes: the finished send is not waited for again
    assert torch.equal(out, torch.arange(world).repeat_interleave(100).float())


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
    from shardwise._registry import unit_of

    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    last = unit_of(model.blocks[-1])
    for step in range(2):
        loss = model(x, x)
        # From the second step on, the order is known: the last block's backward comes
        # first, so it stays gathered; the others are freed.
        assert last.state.value == ("gathered" if step else "sharded")
        assert unit_of(model.blocks[0]).state.value == "sharded"
        loss.backward()
        assert last.state.value == "sharded"  # released with everything at backward's end
    frozen = sw.shard(_LastFrozen(), units=lambda name, m: name.startswith("blocks."))
    for _ in range(2):
        out = frozen(torch.randn(2, 8)).sum()
        # Its output needs no gradient, so no backward will gather it: freed at once.
        assert unit_of(frozen.blocks[2]).state.value == "sharded"
        out.backward()


def test_the_last_unit_stays_gathered_for_its_backward_unless_it_has_none():
    run_ranks(_last_unit_kept, 2)


def _mismatched_kinds(rank, world):
    import datetime

    import torch.distributed as dist

    import shardwise as sw
    from shardwise._comm import Comm

    comm = Comm(dist.new_group(timeout=datetime.timedelta(seconds=3)))
    # Ranks that diverged: rank 0 gathers a shard, rank 1 reduces gradients whose chunk
    # has the shard's size. The messages must not meet (the kinds' tags differ): each
    # rank waits and fails, instead of taking the other's data.
    with pytest.raises(sw.CollectiveError, match="did not complete"):
        if rank == 0:
            comm.all_gather(torch.empty(200), torch.zeros(100))
        else:
            comm.reduce_scatter(torch.empty(100), torch.ones(200))


def test_an_all_gather_never_takes_a_reduce_scatters_messages():
    run_ranks(_mismatched_kinds, 2)


def test_an_interrupted_exchange_wait_resumes():
    # Before, the second wait waited for the finished send again: a CollectiveError at
    # the group's timeout.
    run_ranks(_interrupted_wait, 2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_exchanges_give_the_collectives_results(world):
    run_ranks(_exchanges_match_gloos_collectives, world)
