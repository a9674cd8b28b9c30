"""The gloo exchanges of ``_comm.Comm`` (Note [gloo exchanges]): the results of torch's
own collectives, tags that keep concurrent exchanges and kinds apart, and a wait that
resumes after an interrupt. These test the private module itself, so they use it."""

import datetime

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import shardwise as sw
from shardwise.comm.collectives import Comm


def _exchanges_match_gloos_collectives(rank, world):
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
    # Not 3 s: the peer's all-gather must start within the timeout, even on a loaded
    # machine; a regression still fails, at the timeout.
    comm = Comm(dist.new_group(timeout=datetime.timedelta(seconds=30)))
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


def _mismatched_kinds(rank, world):
    import os

    # The tags alone, without the order check's headers (which would say "ranks
    # diverged" first: test_divergence.py).
    os.environ["SHARDWISE_CHECK"] = "0"
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


def _transports_on_their_own(rank, world):
    from shardwise.comm.collectives import COLLECTIVES, EXCHANGES

    comm = Comm(None)
    g = torch.Generator().manual_seed(rank)
    assert comm.transport(torch.ones(1)) is EXCHANGES  # CPU tensors under gloo
    inp, shard = torch.randn(world * 64, generator=g), torch.randn(50, generator=g)
    results = {}
    for transport in (COLLECTIVES, EXCHANGES):  # the same interface, each on its own
        out, gathered = torch.empty(64), torch.empty(world * 50)
        transport.reduce_scatter(comm, out, inp, "a test").wait()
        transport.all_gather(comm, gathered, shard, "a test").wait()
        results[transport] = out, gathered
    expect_rs, expect_ag = torch.empty(64), torch.empty(world * 50)
    dist.reduce_scatter_tensor(expect_rs, inp.clone())
    dist.all_gather_into_tensor(expect_ag, shard)
    for out, gathered in results.values():
        assert torch.equal(out, expect_rs) and torch.equal(gathered, expect_ag)  # N=2: exact


def test_each_transport_gives_the_collectives_results():
    run_ranks(_transports_on_their_own, 2)


def _interrupted_header(rank, world):
    """An order-check header waited for on the helper thread, the wait interrupted
    (Ctrl-C, or the peer watch's error): the retry waits for the same helper. Before,
    the retry compared a header that had not arrived yet, and only this rank raised."""
    import os
    import time

    import shardwise.comm.channel as ch

    os.environ.pop("SHARDWISE_CHECK", None)
    comm = Comm(dist.new_group(timeout=datetime.timedelta(seconds=20)))
    channel = comm.channel
    if rank == 1:
        time.sleep(3)  # slow to send its header: rank 0's wait moves to the helper
        channel.post(ch.OPERATION, 7, 0, "op", "op")
        channel.settle()
        return channel.epoch
    channel.post(ch.OPERATION, 7, 0, "op", "op")
    real = ch.wait_watched

    def interrupted(*_):
        time.sleep(0.5)
        raise KeyboardInterrupt

    ch.wait_watched = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            channel.settle()
    finally:
        ch.wait_watched = real
    channel.settle()  # resumes: no divergence, the same epoch on both ranks
    return channel.epoch


def test_an_interrupted_header_wait_resumes():
    assert run_ranks(_interrupted_header, 2, timeout=60) == [0, 0]
